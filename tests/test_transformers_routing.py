"""deformconv.integrations.use_for("transformers"): transformers' own models, built small with
random weights, on deformconv's op, against their own pure-PyTorch path in float64: the outputs,
the gradients of the image and of every parameter, and every MSDA call routed."""

import importlib
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (requirements-dev.txt)")

from deformconv import integrations  # noqa: E402
from deformconv.integrations import transformers_models  # noqa: E402
from transformers_families import CLASS_FORM, FAMILIES  # noqa: E402

pytestmark = pytest.mark.workflows


@pytest.fixture
def unrouted():
    """Leaves transformers unrouted after the test, whatever it routed."""
    integrations.restore("transformers")
    yield
    integrations.restore("transformers")


def counted(function, counter):
    def call(*args, **kwargs):
        counter[0] += 1
        return function(*args, **kwargs)
    return call


def count_own_calls(monkeypatch, module, form):
    """Counts the calls of `module`'s form `form` (for the class, of its forward) while
    monkeypatch holds."""
    counter = [0]
    target = getattr(module, form)
    if form == CLASS_FORM:
        monkeypatch.setattr(target, "forward", counted(target.forward, counter))
    else:
        monkeypatch.setattr(module, form, counted(target, counter))
    return counter


def floating_leaves(output):
    """The floating-point tensors of a model output, in a fixed order."""
    leaves = []
    for value in (output.to_tuple() if hasattr(output, "to_tuple") else output):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                leaves.append(value)
        elif isinstance(value, (tuple, list)) or hasattr(value, "to_tuple"):
            leaves.extend(floating_leaves(value))
    return leaves


def forward_and_gradients(model, inputs):
    """The model's floating outputs and the gradients of the image and every parameter, of a
    fixed random combination of the outputs."""
    inputs = {key: value.double().requires_grad_() if value.is_floating_point() else value
              for key, value in inputs.items()}
    outputs = floating_leaves(model(**inputs))
    generator = torch.Generator().manual_seed(7)
    loss = sum((out * torch.randn(out.shape, generator=generator, dtype=out.dtype)).sum()
               for out in outputs)
    leaves = [inputs["pixel_values"]] + [p for p in model.parameters() if p.requires_grad]
    # Zeros for what the loss does not reach: with nearest sampling, the layers that make the
    # locations, which the op gives a zero gradient and transformers' integer cast none.
    grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    return [out.detach() for out in outputs], list(grads)


def relative_difference(ours, theirs):
    """The largest difference of a tensor relative to its largest expected magnitude, or to a
    thousandth of the largest finite magnitude of them all where that is more: a gradient that
    is zero in exact arithmetic (a bias before a normalisation, a key's bias before a softmax)
    is rounding noise on both sides. Infinities (masked logits) must be at the same places."""
    floor = 1e-3 * max(b[b.isfinite()].abs().max().item() for b in theirs if b.isfinite().any())
    worst = 0.0
    for a, b in zip(ours, theirs):
        finite = b.isfinite()
        assert torch.equal(a[~finite], b[~finite])
        scale = b[finite].abs().max().clamp_min(floor) if finite.any() else 1.0
        worst = max(worst, ((a[finite] - b[finite]).abs().max() / scale).item()
                    if finite.any() else 0.0)
    return worst


def build(family):
    """The family's model in float64, in eval mode (no dropout), its parameters moved off their
    initial values: Deformable DETR-style initialisations put every sampling location on a
    pixel centre, where bilinear sampling has no derivative and grid_sample's and the op's
    one-sided ones may differ by the rounding of the coordinate."""
    make, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    model, inputs = make()
    model = model.double().eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator,
                                              dtype=parameter.dtype))
    return model, inputs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_routed_model_matches_its_own_path(family, unrouted, monkeypatch):
    _, module_name, form = FAMILIES[family]
    module = importlib.import_module(module_name)
    with monkeypatch.context() as counting:
        own = count_own_calls(counting, module, form)
        model, inputs = build(family)
        expected_outputs, expected_grads = forward_and_gradients(model, inputs)
    assert own[0] > 0

    routed = [0]
    monkeypatch.setattr(transformers_models, "ms_deform_attn",
                        counted(transformers_models.ms_deform_attn, routed))
    integrations.use_for("transformers")
    # D-FINE and DEIMv2 keep the function they were built with: a model built after the call.
    routed_model, _ = build(family)
    routed_model.load_state_dict(model.state_dict())
    outputs, grads = forward_and_gradients(routed_model, inputs)
    assert routed[0] == own[0]
    assert len(outputs) == len(expected_outputs) and len(grads) == len(expected_grads)
    assert relative_difference(outputs, expected_outputs) < 1e-9
    assert relative_difference(grads, expected_grads) < 1e-9


LAZY_IMPORT = """
import sys
import torch
import deformconv.integrations
from deformconv.integrations import transformers_models
deformconv.integrations.use_for("transformers")
modeling = "transformers.models.{family}.modeling_{family}"
assert modeling not in sys.modules
calls = []
op = transformers_models.ms_deform_attn
transformers_models.ms_deform_attn = lambda *args, **kwargs: calls.append(1) or op(*args, **kwargs)
import transformers
model = getattr(transformers, "{model}")(getattr(transformers, "{config}")(**{options}))
model.eval()(pixel_values=torch.randn(1, 3, 64, 64))
assert modeling in sys.modules and calls, (modeling in sys.modules, calls)
print(len(calls))
"""


@pytest.mark.parametrize("family,model,config,options", [
    ("rt_detr", "RTDetrForObjectDetection", "RTDetrConfig",
     "dict(backbone_config=transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 24, "
     "32], depths=[1, 1, 1, 1], out_features=['stage2', 'stage3', 'stage4']), "
     "encoder_in_channels=[16, 24, 32], use_pretrained_backbone=False, d_model=16, "
     "encoder_hidden_dim=16, decoder_in_channels=[16, 16, 16], num_queries=8, "
     "decoder_layers=1)"),
    ("mask2former", "Mask2FormerForUniversalSegmentation", "Mask2FormerConfig",
     "dict(backbone_config=transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 24, "
     "32], depths=[1, 1, 1, 1], out_features=['stage1', 'stage2', 'stage3', 'stage4']), "
     "use_pretrained_backbone=False, feature_size=32, mask_feature_size=32, hidden_dim=32, "
     "encoder_layers=1, decoder_layers=2, num_queries=8)"),
])
def test_modeling_modules_imported_after_the_call_are_routed(tmp_path, family, model, config,
                                                              options):
    """transformers imports its modeling modules lazily (here through the top-level names):
    a module first imported after use_for is routed as it is imported."""
    from fresh_process import run_script

    result = run_script(LAZY_IMPORT.format(family=family, model=model, config=config,
                                           options=options), tmp_path, HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) > 0


@pytest.mark.parametrize("family", ["deformable_detr", "rt_detr_v2", "mask2former",
                                    "d_fine-3-6-3"])
def test_models_built_before_the_call(family, unrouted, monkeypatch):
    """The class form and the functions looked up at each call route models built before
    use_for; D-FINE and DEIMv2, which store the function when they are built, keep theirs."""
    model, inputs = build(family)
    routed = [0]
    monkeypatch.setattr(transformers_models, "ms_deform_attn",
                        counted(transformers_models.ms_deform_attn, routed))
    integrations.use_for("transformers")
    with torch.no_grad():
        model(**{key: value.double() if value.is_floating_point() else value
                 for key, value in inputs.items()})
    assert (routed[0] > 0) == (not family.startswith("d_fine"))


def test_restore_puts_the_originals_back(unrouted):
    _, module_name, _ = FAMILIES["mask2former"]
    module = importlib.import_module(module_name)
    detr = importlib.import_module(FAMILIES["deformable_detr"][1])
    original_function = module.multi_scale_deformable_attention
    original_forward = detr.MultiScaleDeformableAttention.forward
    integrations.use_for("transformers")
    integrations.use_for("transformers")  # a second call changes nothing more
    assert module.multi_scale_deformable_attention is \
        transformers_models.multi_scale_deformable_attention
    assert detr.MultiScaleDeformableAttention.forward is \
        transformers_models.multi_scale_deformable_attention_forward
    integrations.restore("transformers")
    assert module.multi_scale_deformable_attention is original_function
    assert detr.MultiScaleDeformableAttention.forward is original_forward
    assert not transformers_models._IMPORTED_LATER.installed()


def test_a_form_of_another_signature_keeps_its_own_code(unrouted, monkeypatch):
    """A modeling module whose form has other parameters (another release of transformers,
    say) is left as it is."""
    import types

    module = types.ModuleType("transformers.models.other.modeling_other")

    def multi_scale_deformable_attention(value, spatial_shapes, locations, weights, extra):
        return value

    module.multi_scale_deformable_attention = multi_scale_deformable_attention
    monkeypatch.setitem(sys.modules, module.__name__, module)
    integrations.use_for("transformers")
    assert module.multi_scale_deformable_attention is multi_scale_deformable_attention


def test_an_unknown_method_is_refused_by_name(unrouted):
    """The v2 function's method other than "default" and "discrete" (the families' tests run
    both)."""
    value = torch.randn(1, 6, 1, 2, dtype=torch.float64)
    locations = torch.rand(1, 3, 1, 2, 2, dtype=torch.float64)
    weights = torch.rand(1, 3, 1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="method must be 'default' or 'discrete', got 'cubic'"):
        transformers_models.multi_scale_deformable_attention_v2(
            value, [(2, 3)], locations, weights, [2], "cubic")


def test_compiled_routed_model_has_no_graph_break_at_the_op(unrouted):
    """torch.compile of a routed RT-DETRv2: transformers' own code breaks the graph (a shape
    check's .item() before each MSDA call), the routed call does not: no break is in
    deformconv's code or names its op, and the op is inside a captured graph (the decoder's
    two layers run one compiled graph of the code after that check)."""
    integrations.use_for("transformers")
    model, inputs = build("rt_detr_v2")
    explanation = torch._dynamo.explain(model)(pixel_values=inputs["pixel_values"].double())
    for reason in explanation.break_reasons:
        where = " ".join(frame.filename for frame in reason.user_stack)
        assert "deformconv" not in where and "ms_deform_attn" not in str(reason), reason
    targets = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]
    assert "deformconv.ms_deform_attn" in targets, targets
    torch._dynamo.reset()
