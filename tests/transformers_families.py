"""transformers' model families with multi-scale deformable attention, each built small from a
config with random weights (no download, no pretrained backbone: a ResNet of four one-block
stages), and the inputs of one forward. FAMILIES maps a name to (build, modeling module, form):
build() gives (model, inputs); the form is the name that the modeling module routes."""

import torch
import transformers as T

CLASS_FORM = "MultiScaleDeformableAttention"
V2_FORM = "multi_scale_deformable_attention_v2"
PIXEL_DECODER_FORM = "multi_scale_deformable_attention"


def _resnet(stages=("stage2", "stage3", "stage4")):
    return T.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 24, 32],
                          depths=[1, 1, 1, 1], out_features=list(stages), layer_type="basic")


def _seeded(shape, high=None):
    generator = torch.Generator().manual_seed(len(shape))
    if high is None:
        return torch.randn(shape, generator=generator)
    return torch.randint(1, high, shape, generator=generator)


def _image(size):
    return {"pixel_values": _seeded((1, 3, size, size))}


def _deformable_detr(**options):
    # d_model 32: the input projections' GroupNorm has 32 groups.
    config = T.DeformableDetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=_resnet(),
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_queries=8,
        encoder_n_points=2, decoder_n_points=2, num_labels=3, **options)
    return T.DeformableDetrForObjectDetection(config), _image(96)


def _rt_detr_options(**options):
    return dict(backbone_config=_resnet(), use_pretrained_backbone=False,
                encoder_in_channels=[16, 24, 32], encoder_hidden_dim=16, encoder_ffn_dim=16,
                encoder_attention_heads=2, d_model=16, decoder_in_channels=[16, 16, 16],
                decoder_ffn_dim=16, decoder_attention_heads=2, decoder_layers=2, num_queries=8,
                num_denoising=0, num_labels=3, decoder_n_points=2, **options)


def _grounding_dino(config_class=T.GroundingDinoConfig,
                    model_class=T.GroundingDinoForObjectDetection):
    text = T.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=16)
    config = config_class(
        backbone_config=_resnet(), use_timm_backbone=False, use_pretrained_backbone=False,
        text_config=text, d_model=32, encoder_layers=1, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_queries=8, encoder_n_points=2, decoder_n_points=2,
        max_text_len=8)
    return model_class(config), {**_image(96), "input_ids": _seeded((1, 6), high=50)}


_SEGMENTATION = dict(backbone_config=_resnet(("stage1", "stage2", "stage3", "stage4")),
                     use_pretrained_backbone=False, hidden_dim=32, encoder_feedforward_dim=32,
                     encoder_layers=1, decoder_layers=2, num_attention_heads=2,
                     dim_feedforward=32, num_queries=8, num_labels=3)


def _mask2former():
    config = T.Mask2FormerConfig(feature_size=32, mask_feature_size=32, **_SEGMENTATION)
    return T.Mask2FormerForUniversalSegmentation(config), _image(64)


def _oneformer():
    config = T.OneFormerConfig(
        conv_dim=32, mask_dim=32, text_encoder_width=32, text_encoder_num_layers=1,
        text_encoder_vocab_size=50, task_seq_len=6, text_encoder_context_length=6,
        text_encoder_n_ctx=2, query_dec_layers=1, is_training=False, **_SEGMENTATION)
    return (T.OneFormerForUniversalSegmentation(config),
            {**_image(64), "task_inputs": _seeded((1, 6), high=50)})


def _modeling(family):
    return f"transformers.models.{family}.modeling_{family}"


FAMILIES = {
    "deformable_detr": (_deformable_detr, _modeling("deformable_detr"), CLASS_FORM),
    "deformable_detr-two-stage-box-refine": (
        lambda: _deformable_detr(two_stage=True, with_box_refine=True,
                                 two_stage_num_proposals=8),
        _modeling("deformable_detr"), CLASS_FORM),
    "rt_detr": (lambda: (T.RTDetrForObjectDetection(T.RTDetrConfig(**_rt_detr_options())),
                         _image(64)), _modeling("rt_detr"), CLASS_FORM),
    "rt_detr_v2": (lambda: (T.RTDetrV2ForObjectDetection(
        T.RTDetrV2Config(**_rt_detr_options())), _image(64)), _modeling("rt_detr_v2"), V2_FORM),
    "rt_detr_v2-discrete": (lambda: (T.RTDetrV2ForObjectDetection(
        T.RTDetrV2Config(**_rt_detr_options(decoder_method="discrete"))), _image(64)),
        _modeling("rt_detr_v2"), V2_FORM),
    "d_fine-3-6-3": (lambda: (T.DFineForObjectDetection(T.DFineConfig(
        **{**_rt_detr_options(), "decoder_n_points": [3, 6, 3]})), _image(64)),
        _modeling("d_fine"), V2_FORM),
    "deimv2": (lambda: (T.Deimv2ForObjectDetection(T.Deimv2Config(**_rt_detr_options())),
                        _image(64)), _modeling("deimv2"), V2_FORM),
    "grounding_dino": (_grounding_dino, _modeling("grounding_dino"), CLASS_FORM),
    "mm_grounding_dino": (
        lambda: _grounding_dino(T.MMGroundingDinoConfig, T.MMGroundingDinoForObjectDetection),
        _modeling("mm_grounding_dino"), CLASS_FORM),
    "mask2former": (_mask2former, _modeling("mask2former"), PIXEL_DECODER_FORM),
    "oneformer": (_oneformer, _modeling("oneformer"), PIXEL_DECODER_FORM),
}
