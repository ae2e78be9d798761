"""``accelerate.utils.modeling``: sizes, tied weights, and moving or loading a model's tensors one by one.

Sizes are in bytes and read only shapes and dtypes (models on the meta device work too). The loaders read
safetensors and ``.bin`` files, ``.bin`` only with ``torch.load(weights_only=True)``. Offloading weights to
disk and bitsandbytes' 8-bit statistics are not supported (lockstep does not dispatch models across
devices with hooks); asking for them raises ``NotImplementedError``. Accelerate's big-model inference
planners (``infer_auto_device_map``, ``get_balanced_memory``) are not provided.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> model[1].weight = model[0].weight
    >>> find_tied_parameters(model)
    [['0.weight', '1.weight']]
    >>> sizes = compute_module_sizes(model)
    >>> sizes[""], sizes["0"], sizes["1"]  # the tied weight counts once, under its first name
    (96, 80, 16)
"""

from lockstep.utils._loading import load_checkpoint_in_model, load_state_dict
from lockstep.utils._model_tensors import (
    calculate_maximum_sizes,
    check_device_map,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    find_tied_parameters,
    get_grad_scaler,
    get_max_layer_size,
    get_max_memory,
    get_mixed_precision_context_manager,
    get_non_persistent_buffers,
    id_tensor_storage,
    is_peft_model,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)

__all__ = [
    "calculate_maximum_sizes",
    "check_device_map",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "get_non_persistent_buffers",
    "id_tensor_storage",
    "is_peft_model",
    "load_checkpoint_in_model",
    "load_state_dict",
    "named_module_tensors",
    "retie_parameters",
    "set_module_tensor_to_device",
]
