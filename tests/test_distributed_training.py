"""Each op on DTensors, and training with each module under DistributedDataParallel and FSDP2
(torch.distributed.fsdp.fully_shard), in 2 processes over gloo, against the same in one
process."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deform_conv2d_cases
import deformconv
import ms_deform_attn_reference
from op_cases import CASES, deform_conv2d_case

pytestmark = pytest.mark.workflows

SHAPES = torch.tensor([[4, 6], [2, 3]])
STARTS = torch.tensor([0, 24])


class Attention(torch.nn.Module):
    """MSDeformAttn over two levels, its queries the first of the flattened input's rows."""

    def __init__(self):
        super().__init__()
        self.attention = deformconv.MSDeformAttn(d_model=16, n_levels=2, n_heads=2, n_points=2)

    def forward(self, x):
        queries = x[:, :5]
        reference_points = torch.linspace(0.1, 0.9, 5 * 2 * 2, dtype=x.dtype).view(1, 5, 2, 2)
        return self.attention(queries, reference_points.expand(x.shape[0], -1, -1, -1), x,
                              SHAPES, STARTS)


class Dcnv4(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dcnv4 = deformconv.DCNv4(16, group=2)

    def forward(self, x):
        return self.dcnv4(x, (5, 6))


# Each module and the shape of one sample of its input.
MODELS = {
    "deform_conv2d": (lambda: torch.nn.Sequential(
        deformconv.ModulatedDeformConv2dPack(4, 6, 3, padding=1, deform_groups=2),
        torch.nn.ReLU(), torch.nn.Conv2d(6, 3, 1)), (4, 5, 6)),
    "dcnv3": (lambda: deformconv.DCNv3(16, group=4), (5, 6, 16)),
    "dcnv4": (Dcnv4, (30, 16)),
    "ms_deform_attn": (Attention, (30, 16)),
}
STEPS = 3


def make_model(name):
    torch.manual_seed(0)
    model = MODELS[name][0]().double()
    with torch.no_grad():  # off the zero offsets of the initialisation, which sit on pixels
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def training_data(name):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, *MODELS[name][1], generator=generator, dtype=torch.float64)
    with torch.no_grad():
        shape = make_model(name)(x).shape
    return x, torch.randn(shape, generator=generator, dtype=torch.float64)


def train(model, x, target):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()


def join(rank, world_size, init_file):
    """This process in the gloo group of world_size; returns the mesh of them all."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    torch.set_num_threads(1)
    return init_device_mesh("cpu", (world_size,))


def leave(rank, result, result_file):
    """Rank 0 saves the result; then both ranks leave at once, without tearing gloo down: its
    teardown can destroy a thread that is still running, which aborts the process ("terminate
    called without an active exception", seen in CI after this barrier and
    destroy_process_group). The result is on disk; closing the sockets is all the exit has to
    do."""
    if rank == 0:
        torch.save(result, result_file)
    dist.barrier()
    os._exit(0)


def data_parallel_worker(rank, world_size, init_file, result_file, wrapper):
    mesh = join(rank, world_size, init_file)
    states = {}
    for name in MODELS:
        model = make_model(name)
        if wrapper == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        x, target = training_data(name)
        half = x.shape[0] // world_size
        shard = slice(rank * half, (rank + 1) * half)
        train(model, x[shard], target[shard])
        if wrapper == "fsdp2":  # each parameter a DTensor, sharded: gathered
            states[name] = {key: value.full_tensor()
                            for key, value in model.state_dict().items()}
        else:
            states[name] = model.module.state_dict()
    leave(rank, states, result_file)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_trains_each_module_as_one_process_does(tmp_path, wrapper):
    """DistributedDataParallel, and FSDP2 (fully_shard), which gathers the parameters before
    the forward: each rank half the batch, the gradients of the mean loss over equal halves
    averaged, which is the gradient on the whole batch."""
    result_file = str(tmp_path / "result.pt")
    mp.spawn(data_parallel_worker, args=(2, str(tmp_path / "init"), result_file, wrapper),
             nprocs=2, join=True)
    distributed = torch.load(result_file)
    for name in MODELS:
        model = make_model(name)
        initial = {key: value.clone() for key, value in model.state_dict().items()}
        train(model, *training_data(name))
        # The steps moved the weights, so that equal results say the training matched.
        assert all(not torch.equal(value, initial[key])
                   for key, value in model.state_dict().items() if key.endswith("weight"))
        for key, value in model.state_dict().items():
            torch.testing.assert_close(distributed[name][key], value, atol=1e-10, rtol=1e-10,
                                       msg=f"{name}: {key}")


# DTensor: each op's operands distributed over a mesh of the 2 processes.

def dtensor_cases():
    """(name, call(operands), operands, placement of each operand by name, the placements the
    output must have or None where DTensor may choose, the operands that require a gradient)."""
    from torch.distributed.tensor import Replicate, Shard

    whole, batch = Replicate(), Shard(0)
    cases = []
    for op in ("deform_conv2d", "dcnv3", "dcnv4"):
        operands, call = CASES[op]()
        layer = {"weight", "bias"}
        cases.append((f"{op}-batch", call, operands,
                      {name: whole if name in layer else batch for name in operands}, [batch],
                      list(operands)))
        cases.append((f"{op}-batch-first-gradient", call, operands,
                      {name: whole if name in layer else batch for name in operands}, [batch],
                      list(operands)[:1]))
        # A placement no rule lists (the images sharded on a spatial dimension): redistributed.
        cases.append((f"{op}-spatial", call, operands,
                      {name: whole if name in layer else Shard(2) for name in operands}, None,
                      list(operands)))
    operands, call = deform_conv2d_case(deform_conv2d_cases.GEOMETRIES[1])  # no conv groups
    cases.append(("deform_conv2d-output-channels", call, operands,
                  {name: batch if name in ("weight", "bias") else whole for name in operands},
                  [Shard(1)], list(operands)))
    value, shapes, starts, locations, weights = ms_deform_attn_reference.make_operands(
        [(4, 6), (2, 3)])
    operands = dict(value=value, spatial_shapes=shapes, level_start_index=starts,
                    sampling_locations=locations, attention_weights=weights)

    def attention(t):
        return torch.ops.deformconv.ms_deform_attn(
            t["value"], t["spatial_shapes"], t["level_start_index"], t["sampling_locations"],
            t["attention_weights"], 64)

    levels = {"spatial_shapes", "level_start_index"}
    differentiable = ["value", "sampling_locations", "attention_weights"]
    cases.append(("ms_deform_attn-batch", attention, operands,
                  {name: whole if name in levels else batch for name in operands}, [batch],
                  differentiable))
    cases.append(("ms_deform_attn-spatial", attention, operands,
                  {name: whole if name in levels else Shard(1) for name in operands}, None,
                  differentiable))
    return cases


def dtensor_worker(rank, world_size, init_file, result_file):
    from torch.distributed.tensor import distribute_tensor

    mesh = join(rank, world_size, init_file)
    results = {}
    for name, call, operands, placements, _, differentiable in dtensor_cases():
        cotangent = torch.randn(call(operands).shape, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(3))
        local = {key: value.clone().requires_grad_(key in differentiable)
                 for key, value in operands.items()}
        expected = call(local)
        expected_gradients = torch.autograd.grad(expected, [local[key] for key in differentiable],
                                                 cotangent)
        shared = {key: distribute_tensor(value, mesh, [placements[key]]).requires_grad_(
                      key in differentiable) for key, value in operands.items()}
        output = call(shared)
        gradients = torch.autograd.grad(
            output, [shared[key] for key in differentiable],
            distribute_tensor(cotangent, mesh, list(output.placements)))
        # full_tensor gathers: every rank calls it.
        results[name] = {
            "output": (output.placements, (output.full_tensor() - expected).abs().max().item()),
            **{key: (gradient.placements, (gradient.full_tensor() - theirs).abs().max().item())
               for key, gradient, theirs in zip(differentiable, gradients, expected_gradients)}}
    leave(rank, {name: {key: (tuple(str(p) for p in placements), difference)
                        for key, (placements, difference) in result.items()}
                 for name, result in results.items()}, result_file)


def test_each_op_on_dtensors_as_in_one_process(tmp_path):
    """The batch sharded gives a batch-sharded output, per-image gradients sharded alike and the
    layer's as partial sums; DCN v2's weight sharded on its output channels gives an output
    sharded on its channels; other placements are redistributed: the same values in all."""
    result_file = str(tmp_path / "dtensor.pt")
    mp.spawn(dtensor_worker, args=(2, str(tmp_path / "init"), result_file), nprocs=2,
             join=True)
    results = torch.load(result_file)
    for name, _, operands, _, output_placements, differentiable in dtensor_cases():
        result = results[name]
        assert set(result) == {"output", *differentiable}, name
        for key, (_, difference) in result.items():
            assert difference < 1e-12, (name, key, difference)
        if output_placements is not None:
            assert result["output"][0] == tuple(str(p) for p in output_placements), name
    from torch.distributed.tensor import Partial, Shard

    sharded, summed = (str(Shard(0)),), (str(Partial()),)
    batch = results["deform_conv2d-batch"]
    assert (batch["input"][0], batch["weight"][0], batch["bias"][0]) == (sharded, summed, summed)
    channels = results["deform_conv2d-output-channels"]
    assert (channels["input"][0], channels["weight"][0]) == (summed, sharded)


IMPORT_ORDER = """
import os
import sys
import torch
import torch.distributed as dist
{imports}
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
dist.init_process_group("gloo", init_method="file://" + os.path.join(os.getcwd(), "init"),
                        rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
value = distribute_tensor(torch.randn(1, 4, 6, 6), mesh, [Replicate()])
offset = distribute_tensor(torch.randn(1, 18, 6, 6), mesh, [Replicate()])
weight = distribute_tensor(torch.randn(3, 4, 3, 3), mesh, [Replicate()])
print(deformconv.deform_conv2d(value, offset, weight, padding=1).placements)
"""
IMPORTS = {
    "dtensor-first": "import torch.distributed.tensor\nimport deformconv",
    # Until DTensor is imported, deformconv has not imported it.
    "deformconv-first": "import deformconv\n"
                        "assert 'torch.distributed.tensor' not in sys.modules\n"
                        "import torch.distributed.tensor",
}


@pytest.mark.parametrize("order", list(IMPORTS))
def test_rules_registered_whichever_is_imported_first(tmp_path, order):
    """deformconv registers the rules at its import where DTensor is imported already, and
    when it is imported otherwise (its import is not forced on every user of deformconv)."""
    from fresh_process import run_script

    result = run_script(IMPORT_ORDER.format(imports=IMPORTS[order]), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Replicate()" in result.stdout
