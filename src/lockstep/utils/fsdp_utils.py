"""``accelerate.utils.fsdp_utils``: FSDP model and optimizer state in Accelerate's checkpoint layout.

``save_fsdp_model``/``load_fsdp_model`` and ``save_fsdp_optimizer``/``load_fsdp_optimizer`` write and read what
Accelerate's ``save_state`` writes for FSDP, on lockstep's FSDP2 models: with ``SHARDED_STATE_DICT`` the DCP
folders ``pytorch_model_fsdp_{i}/`` (``{"model": state_dict}``) and ``optimizer_{i}/``
(``{"optimizer": state_dict}``), resharded on load to any number of processes; with ``FULL_STATE_DICT``
``pytorch_model_fsdp.bin`` and ``optimizer.bin``, gathered on and sent from the main process. Files are read
without unpickling arbitrary objects. ``Accelerator.save_state``/``load_state`` do all this and more (a
manifest, an atomic commit); these are for code that calls Accelerate's helpers itself.
``merge_fsdp_weights`` writes one model file from the shards.
``ensure_weights_retied`` keeps tied weights tied while a ``param_init_fn`` materializes a model.

Example:
    >>> save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "out")  # doctest: +SKIP
    >>> load_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "out")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from lockstep import _env
from lockstep.backends.fsdp.loading import why_transformers_cannot_load_on_main_only
from lockstep.checkpoint.collective_save import agree
from lockstep.checkpoint.model_files import save_model_files
from lockstep.state import PartialState
from lockstep.utils._tied_weights import ensure_weights_retied

__all__ = [
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "ensure_weights_retied",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]

_logger = logging.getLogger(__name__)


def enable_fsdp_ram_efficient_loading() -> None:
    """Make transformers' ``from_pretrained`` read the pretrained weights on the main process only (the others
    build the model on the meta device; FSDP's ``cpu_ram_efficient_loading`` then broadcasts the weights).

    Example:
        >>> import os
        >>> enable_fsdp_ram_efficient_loading()
        >>> os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"]
        'True'
        >>> disable_fsdp_ram_efficient_loading()
        >>> os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"]
        'False'

    Where the installed transformers cannot honour it (before 4.51, transformers fails in ``from_pretrained``
    on every process unless its ``is_accelerate_available()`` finds an installed accelerate), nothing is set
    and a warning says why: every process then reads the
    weights, and FSDP's ``cpu_ram_efficient_loading`` still sends the main process's weights at ``prepare``.
    """
    reason = why_transformers_cannot_load_on_main_only()
    if reason is not None:
        _logger.warning("enable_fsdp_ram_efficient_loading() does nothing here: %s.", reason)
        return
    _env.set_rank0_loading(True)


def disable_fsdp_ram_efficient_loading() -> None:
    """Make every process read the pretrained weights in ``from_pretrained`` again (see
    :func:`enable_fsdp_ram_efficient_loading`)."""
    _env.set_rank0_loading(False)


_FSDP_MODEL_NAME = "pytorch_model_fsdp"
_OPTIMIZER_NAME = "optimizer"


def _state_dict_type(fsdp_plugin: Any, caller: str) -> str:
    """``"FULL_STATE_DICT"`` or ``"SHARDED_STATE_DICT"`` from a plugin (a string or torch's enum member)."""
    value = getattr(fsdp_plugin, "state_dict_type", None)
    name = str(getattr(value, "name", value)).upper()
    if name in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        return name
    if fsdp_plugin is None:
        raise TypeError(
            f"{caller}(fsdp_plugin=None): pass the FSDP plugin, e.g. accelerator.state.fsdp_plugin, or a "
            "FullyShardedDataParallelPlugin(state_dict_type=...)."
        )
    raise ValueError(
        f"{caller}: the plugin's state_dict_type={value!r} is not supported: FSDP2 (which lockstep runs) has no "
        "LOCAL_STATE_DICT. Use SHARDED_STATE_DICT or FULL_STATE_DICT."
    )


def _adapter_only(model: nn.Module, adapter_only: bool) -> bool:
    """Accelerate's ``adapter_only``: it applies to peft models only (others are saved whole)."""
    from lockstep.utils.other import is_peft_model

    return adapter_only and is_peft_model(model)


def _file_name(name: str, index: int, suffix: str) -> str:
    return f"{name}{'' if index == 0 else f'_{index}'}{suffix}"


def _dcp_folder(input_dir: str | os.PathLike[str], name: str, index: int) -> Path:
    """The DCP folder to read: ``input_dir/{name}_{index}``, or ``input_dir`` itself when it is one (as
    Accelerate, which takes a folder whose path names ``name``)."""
    from lockstep.backends.fsdp.checkpoint import DCP_METADATA

    folder = Path(input_dir)
    return folder if (folder / DCP_METADATA).is_file() else folder / f"{name}_{index}"


def _on_main(state: PartialState, action: str, work: Callable[[], Any]) -> Any:
    """``work()`` on the main process, its error raised on every process (None elsewhere)."""
    result, error = None, None
    if state.is_main_process:
        try:
            result = work()
        except Exception as caught:
            error = caught
    agree(state, error, action)
    return result


def _check_shards(state: PartialState, folder: Path, caller: str) -> None:
    """The main process checks the DCP folder (present, loads safely) before the collective load."""
    from lockstep.backends.fsdp.checkpoint import DCP_METADATA
    from lockstep.checkpoint import safe_dcp

    def check() -> None:
        if not (folder / DCP_METADATA).is_file():
            raise FileNotFoundError(
                f"{caller}: {folder} is not a sharded checkpoint ({DCP_METADATA} is missing). Pass the folder "
                "save_fsdp_model/save_fsdp_optimizer (or save_state) wrote with SHARDED_STATE_DICT, and the same "
                "model_index/optimizer_index; a FULL_STATE_DICT checkpoint needs a plugin set to FULL_STATE_DICT."
            )
        safe_dcp.check_folder(folder)

    _on_main(state, caller, check)


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
) -> None:
    """Save a prepared FSDP model in Accelerate's layout (every process calls it together).

    Args:
        fsdp_plugin: its ``state_dict_type`` chooses the layout: ``SHARDED_STATE_DICT`` writes every
            process's shards into ``output_dir/pytorch_model_fsdp_{model_index}/`` (DCP, under the key
            ``"model"``); ``FULL_STATE_DICT`` gathers the whole model on the main process into
            ``output_dir/pytorch_model_fsdp.bin`` (``pytorch_model_fsdp_{model_index}.bin`` for others).
        accelerator: the Accelerator (lockstep reads the process state itself).
        model: the prepared model.
        output_dir: the folder; created if missing.
        model_index: the model's position among the prepared models.
        adapter_only: as in Accelerate: for a peft model, save only its adapter (the trainable parameters):
            ``SHARDED_STATE_DICT`` under peft's names (``get_peft_model_state_dict``), ``FULL_STATE_DICT``
            under the model's own names; for any other model it is ignored.

    Example:
        >>> save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "ckpt")  # doctest: +SKIP
    """
    from lockstep.backends.fsdp import checkpoint as shards
    from lockstep.checkpoint.safe_load import safe_torch_save

    kind = _state_dict_type(fsdp_plugin, "save_fsdp_model")
    adapters = _adapter_only(model, adapter_only)
    state = PartialState()
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    if kind == "SHARDED_STATE_DICT":
        save = shards.save_adapter_shards if adapters else shards.save_model_shards
        save(model, output / f"{_FSDP_MODEL_NAME}_{model_index}")
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if adapters:
        whole = shards.full_trainable_state(model, distributed=state.use_distributed)
    else:
        whole = get_model_state_dict(
            getattr(model, "_orig_mod", model),
            options=StateDictOptions(full_state_dict=True, cpu_offload=state.use_distributed),
        )
    path = output / _file_name(_FSDP_MODEL_NAME, model_index, ".bin")
    _on_main(state, "save_fsdp_model", lambda: safe_torch_save(whole, path, where=f"model {model_index}"))


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: nn.Module,
    input_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
) -> Any:
    """Load what :func:`save_fsdp_model` (or Accelerate's) wrote into a prepared FSDP model (a collective).

    Sharded folders load on any number of processes, whatever number wrote them; lockstep's own sharded
    folders (``save_state``) load too. Files are read without unpickling arbitrary objects.

    Args:
        fsdp_plugin: its ``state_dict_type`` says which layout to read (see :func:`save_fsdp_model`).
        accelerator: the Accelerator (lockstep reads the process state itself).
        model: the prepared model.
        input_dir: the folder holding ``pytorch_model_fsdp_{model_index}/`` or the ``.bin`` file; or, for
            ``SHARDED_STATE_DICT``, the DCP folder itself.
        model_index: the model's position among the prepared models.
        adapter_only: for a peft model, load only its adapter (what ``save_fsdp_model(..., adapter_only=True)``
            wrote); the frozen base is left as it is.

    Returns:
        torch's ``(missing_keys, unexpected_keys)`` (peft's load result with ``adapter_only``), as Accelerate
        returns.

    Raises:
        FileNotFoundError: the folder or file is missing.
        UnsafeCheckpointError: a file carries arbitrary Python objects (they are not run).

    Example:
        >>> load_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "ckpt")  # doctest: +SKIP
    """
    from lockstep.backends.fsdp import checkpoint as shards
    from lockstep.checkpoint.safe_load import safe_torch_load

    kind = _state_dict_type(fsdp_plugin, "load_fsdp_model")
    adapters = _adapter_only(model, adapter_only)
    state = PartialState()
    if kind == "SHARDED_STATE_DICT":
        folder = _dcp_folder(input_dir, _FSDP_MODEL_NAME, model_index)
        _check_shards(state, folder, "load_fsdp_model")
        load = shards.load_adapter_shards if adapters else shards.load_model_shards
        return load(model, folder)
    path = Path(input_dir) / _file_name(_FSDP_MODEL_NAME, model_index, ".bin")
    whole = _on_main(state, "load_fsdp_model", lambda: safe_torch_load(path))
    load_full = shards.load_full_trainable if adapters else shards.load_full_model
    return load_full(model, whole or {}, distributed=state.use_distributed)


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
) -> None:
    """Save the state of a prepared optimizer of an FSDP model in Accelerate's layout (a collective).

    Args:
        fsdp_plugin: ``SHARDED_STATE_DICT`` writes ``output_dir/optimizer_{optimizer_index}/`` (DCP, under the
            key ``"optimizer"``); ``FULL_STATE_DICT`` writes ``output_dir/optimizer.bin``
            (``optimizer_{optimizer_index}.bin`` for others) on the main process, keyed by parameter name.
        accelerator: the Accelerator (lockstep reads the process state itself).
        optimizer: the prepared optimizer.
        model: the prepared model whose parameters it updates.
        output_dir: the folder; created if missing.
        optimizer_index: the optimizer's position among the prepared optimizers.

    Example:
        >>> save_fsdp_optimizer(plugin, accelerator, optimizer, model, "ckpt")  # doctest: +SKIP
    """
    from lockstep.backends.fsdp import checkpoint as shards
    from lockstep.checkpoint.safe_load import safe_torch_save

    kind = _state_dict_type(fsdp_plugin, "save_fsdp_optimizer")
    state = PartialState()
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    if kind == "SHARDED_STATE_DICT":
        shards.save_optimizer_shards(model, optimizer, output / f"{_OPTIMIZER_NAME}_{optimizer_index}")
        return
    whole = shards.full_optimizer_state(model, optimizer)
    path = output / _file_name(_OPTIMIZER_NAME, optimizer_index, ".bin")
    _on_main(
        state,
        "save_fsdp_optimizer",
        lambda: safe_torch_save(whole, path, where=f"optimizer {optimizer_index}"),
    )


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: nn.Module,
    input_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    adapter_only: bool = False,
) -> None:
    """Load what :func:`save_fsdp_optimizer` (or Accelerate's) wrote into a prepared optimizer (a collective).

    Args:
        fsdp_plugin: its ``state_dict_type`` says which layout to read (see :func:`save_fsdp_optimizer`).
        accelerator: the Accelerator (lockstep reads the process state itself).
        optimizer: the prepared optimizer.
        model: the prepared model whose parameters it updates.
        input_dir: the folder holding ``optimizer_{optimizer_index}/`` or the ``.bin`` file; or, for
            ``SHARDED_STATE_DICT``, the DCP folder itself.
        optimizer_index: the optimizer's position among the prepared optimizers.
        adapter_only: accepted for Accelerate's signature: the optimizer holds the adapter's state only when
            only the adapter is trainable, so it loads the same way.

    Raises:
        FileNotFoundError: the folder or file is missing.
        UnsafeCheckpointError: a file carries arbitrary Python objects (they are not run).

    Example:
        >>> load_fsdp_optimizer(plugin, accelerator, optimizer, model, "ckpt")  # doctest: +SKIP
    """
    from lockstep.backends.fsdp import checkpoint as shards
    from lockstep.checkpoint.safe_load import safe_torch_load

    kind = _state_dict_type(fsdp_plugin, "load_fsdp_optimizer")
    state = PartialState()
    if kind == "SHARDED_STATE_DICT":
        folder = _dcp_folder(input_dir, _OPTIMIZER_NAME, optimizer_index)
        _check_shards(state, folder, "load_fsdp_optimizer")
        shards.load_optimizer_shards(model, optimizer, folder)
        return
    path = Path(input_dir) / _file_name(_OPTIMIZER_NAME, optimizer_index, ".bin")
    whole = _on_main(state, "load_fsdp_optimizer", lambda: safe_torch_load(path))
    shards.load_full_optimizer(model, optimizer, whole or {}, distributed=state.use_distributed)


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> None:
    """Merge the shards of a ``SHARDED_STATE_DICT`` checkpoint into one model, as ``lockstep merge-weights``.

    Runs on the main process (the others wait), with or without a process group: the checkpoint's
    metadata gives every tensor's global shape, and the shards of all processes are read into whole
    tensors. The model is written into ``output_path`` like ``save_model``: ``model.safetensors`` (or
    ``pytorch_model.bin``), split into 10GB shards with an index when larger.

    Args:
        checkpoint_dir: the model's DCP folder (``pytorch_model_fsdp_0``), or the ``save_state`` folder
            holding it (model 0 is merged).
        output_path: the folder to write into; created if missing.
        safe_serialization: write safetensors; False writes ``torch.save`` ``.bin`` files.
        remove_checkpoint_dir: delete ``checkpoint_dir`` afterwards.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` is not a sharded checkpoint.

    Example:
        >>> merge_fsdp_weights("ckpt/pytorch_model_fsdp_0", "merged")  # doctest: +SKIP
    """
    state = PartialState()
    error: Exception | None = None
    if state.is_main_process:
        try:
            _merge(Path(checkpoint_dir), output_path, safe_serialization, remove_checkpoint_dir)
        except Exception as caught:
            error = caught
    # Every rank learns whether the main process succeeded, instead of waiting at a barrier it never reaches.
    agree(state, error, "merge_fsdp_weights")


def _merge(
    source: Path, output_path: str | os.PathLike[str], safe_serialization: bool, remove_checkpoint_dir: bool
) -> None:
    # Here, not at the top: the backends (and torch's FSDP) are not needed to import lockstep.utils.
    from lockstep.backends.fsdp.checkpoint import read_full_weights, sharded_model_folder

    if not source.is_dir():
        raise FileNotFoundError(
            f"merge_fsdp_weights({str(source)!r}): no such folder. Pass the folder save_state wrote, or its "
            "pytorch_model_fsdp_N subfolder."
        )
    folder = sharded_model_folder(source)
    weights = read_full_weights(folder)  # in this one process, without unpickling arbitrary objects
    written = save_model_files(weights, output_path, safe_serialization=safe_serialization)
    _logger.info("Merged %d tensors from %s into %s", len(weights), folder, written[0].parent)
    if remove_checkpoint_dir:
        shutil.rmtree(source)
