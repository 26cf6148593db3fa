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


def _lw_detr():
    # A ViT of four blocks (two windowed), patches of 8: two feature levels (strides 16, 4).
    vit = T.LwDetrViTConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                            image_size=64, pretrain_image_size=64, patch_size=8,
                            window_block_indices=[0, 2], out_indices=[1, 3], num_windows=4)
    config = T.LwDetrConfig(
        backbone_config=vit, projector_scale_factors=[0.5, 2.0], c2f_num_blocks=1, d_model=16,
        decoder_ffn_dim=16, decoder_n_points=2, decoder_layers=2,
        decoder_self_attention_heads=2, decoder_cross_attention_heads=2, num_queries=8,
        group_detr=2, num_labels=3)
    return T.LwDetrForObjectDetection(config), _image(64)


def _rf_detr():
    # A DINOv2 of four blocks, patches of 14; RF-DETR's decoder reads one feature level.
    dinov2 = T.RfDetrDinov2Config(hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                                  image_size=56, patch_size=14, out_indices=[1, 3], num_windows=2)
    config = T.RfDetrConfig(
        backbone_config=dinov2, d_model=16, decoder_ffn_dim=16, intermediate_size=16,
        decoder_n_points=2, decoder_layers=2, decoder_self_attention_heads=2,
        decoder_cross_attention_heads=2, num_queries=8, group_detr=2, num_labels=3)
    return T.RfDetrForObjectDetection(config), _image(56)


def _omdet_turbo():
    # transformers' own Swin (channels first, so no layer norm after it: that one expects timm's
    # channels-last maps); the task encoder reads the text model's states, of class_embed_dim,
    # which must differ from the decoder's width (equal widths leave task_project undefined).
    swin = T.SwinConfig(image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1],
                        num_heads=[1, 1, 2, 2], window_size=4, out_indices=[2, 3, 4])
    text = T.CLIPTextConfig(vocab_size=50, hidden_size=24, intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2,
                            max_position_embeddings=8, bos_token_id=0, eos_token_id=1)
    config = T.OmDetTurboConfig(
        text_config=text, backbone_config=swin, use_timm_backbone=False, image_size=64,
        apply_layernorm_after_vision_backbone=False, text_projection_in_dim=24,
        text_projection_out_dim=24, task_encoder_hidden_dim=16, class_embed_dim=24,
        num_queries=8, encoder_hidden_dim=16, vision_features_channels=[16, 16, 16],
        encoder_in_channels=[16, 32, 64], encoder_attention_heads=2, encoder_dim_feedforward=16,
        decoder_hidden_dim=16, decoder_num_heads=2, decoder_num_layers=2,
        decoder_dim_feedforward=16, decoder_num_points=2, cache_size=4)
    classes = 3
    return T.OmDetTurboForObjectDetection(config), {
        **_image(64), "classes_input_ids": _seeded((classes, 6), high=50),
        "classes_attention_mask": torch.ones(classes, 6, dtype=torch.int64),
        "tasks_input_ids": _seeded((1, 5), high=50),
        "tasks_attention_mask": torch.ones(1, 5, dtype=torch.int64),
        "classes_structure": torch.tensor([classes])}


def _pp_doclayout(version):
    options = _rt_detr_options()
    if version == 2:
        # The reading-order head, small; thresholds and an order for the three labels.
        reading_order = dict(hidden_size=16, num_attention_heads=2, intermediate_size=16,
                             num_hidden_layers=1, coordinate_size=3, shape_size=2,
                             global_pointer_head_size=8, relation_bias_embed_dim=4)
        config = T.PPDocLayoutV2Config(reading_order_config=reading_order,
                                       class_thresholds=[0.5] * 3, class_order=[0, 1, 2],
                                       **options)
        return T.PPDocLayoutV2ForObjectDetection(config), _image(64)
    if version == 3:
        # The mask head also reads the backbone's first stage (x4_feat_dim, its 8 channels).
        options["backbone_config"] = _resnet(("stage1", "stage2", "stage3", "stage4"))
        config = T.PPDocLayoutV3Config(mask_feature_channels=[8, 8], num_prototypes=4,
                                       x4_feat_dim=8, global_pointer_head_size=8, **options)
        return T.PPDocLayoutV3ForObjectDetection(config), _image(64)
    config = T.PPDocLayoutV4Config(hidden_size=16, global_pointer_head_size=8, **options)
    return T.PPDocLayoutV4ForObjectDetection(config), _image(64)


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
    "lw_detr": (_lw_detr, _modeling("lw_detr"), CLASS_FORM),
    "rf_detr": (_rf_detr, _modeling("rf_detr"), CLASS_FORM),
    "omdet_turbo": (_omdet_turbo, _modeling("omdet_turbo"), CLASS_FORM),
    "pp_doclayout_v2": (lambda: _pp_doclayout(2), _modeling("pp_doclayout_v2"), CLASS_FORM),
    "pp_doclayout_v3": (lambda: _pp_doclayout(3), _modeling("pp_doclayout_v3"), CLASS_FORM),
    "pp_doclayout_v4": (lambda: _pp_doclayout(4), _modeling("pp_doclayout_v4"), CLASS_FORM),
}
