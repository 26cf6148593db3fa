"""Other codebases' model code, unchanged, on deformconv: :func:`use_for`.

- **The originals' model files** (InternImage, FlashInternImage, Deformable DETR and the copies
  of its ops folder in DINO, DN-DETR and their descendants) import the originals' compiled op
  packages at import time: ``from ops_dcnv3 import modules as opsm`` (then ``getattr(opsm,
  core_op)`` with ``'DCNv3'`` or ``'DCNv3_pytorch'``), ``import DCNv4`` (``DCNv4``,
  ``FlashDeformAttn``, ``FlashDeformAttnFunction``), ``import MultiScaleDeformableAttention as
  MSDA`` (whose ``ms_deform_attn_forward`` and ``ms_deform_attn_backward`` Deformable DETR's
  autograd function calls). Those packages need their CUDA extensions (and DCNv4 a GPU at
  import). ``use_for("internimage")``, ``"flash_internimage"`` or ``"deformable_detr"`` puts
  stand-ins for them into ``sys.modules``, whose classes and functions are deformconv's
  (:mod:`deformconv.integrations.original_packages`); call it before the model file is
  imported, which otherwise keeps what it imported::

      import deformconv.integrations
      deformconv.integrations.use_for("internimage")
      from models.intern_image import InternImage       # builds deformconv.DCNv3

- **Hugging Face transformers** computes multi-scale deformable attention in pure PyTorch in
  some 15 modeling files. ``use_for("transformers")`` routes each of its three forms to
  :func:`deformconv.ms_deform_attn`, in the modules imported already and in those imported
  later, with no model code or weight edited
  (:mod:`deformconv.integrations.transformers_models`). D-FINE and DEIMv2 store the function on
  each attention module when it is built: build those models after the call.

:func:`restore` undoes :func:`use_for`.
"""

import sys

from . import original_packages, transformers_models
from .original_packages import (DCNv3Function, DCNv4Function, FlashDeformAttnFunction,
                                dcnv3_core_pytorch, ms_deform_attn_backward,
                                ms_deform_attn_forward)

CODEBASES = ("internimage", "flash_internimage", "deformable_detr", "transformers")


def _check(function: str, codebase: str) -> None:
    if codebase not in CODEBASES:
        raise ValueError(f"deformconv.integrations.{function}: codebase must be one of "
                         f"{', '.join(repr(c) for c in CODEBASES)}, got {codebase!r}")


def use_for(codebase: str) -> None:
    """Makes ``codebase`` ("internimage", "flash_internimage", "deformable_detr" or
    "transformers") run its deformable ops on deformconv: for the first three, registers the
    stand-ins of their op packages in ``sys.modules``, in place of any original package (call
    it before the model file is imported); for "transformers", routes its multi-scale
    deformable attention (call it before building D-FINE or DEIMv2 models)."""
    _check("use_for", codebase)
    if codebase == "transformers":
        transformers_models.route()
    else:
        sys.modules.update(original_packages.stand_ins(codebase))


def restore(codebase: str) -> None:
    """Undoes :func:`use_for`: the stand-ins leave ``sys.modules`` (model files imported
    meanwhile keep what they imported), or transformers' own functions come back."""
    _check("restore", codebase)
    if codebase == "transformers":
        transformers_models.unroute()
        return
    for name in original_packages.stand_ins(codebase):
        if original_packages.is_stand_in(sys.modules.get(name)):
            del sys.modules[name]


__all__ = ["CODEBASES", "DCNv3Function", "DCNv4Function", "FlashDeformAttnFunction",
           "dcnv3_core_pytorch", "ms_deform_attn_backward", "ms_deform_attn_forward",
           "restore", "use_for"]
