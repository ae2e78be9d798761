"""``lockstep.utils.environment``, ``.imports`` and ``.versions``: environment helpers restore what they
change, availability checks report what is installed, and versions compare as Accelerate's do."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from packaging.version import Version

from lockstep.utils import environment as env
from lockstep.utils import imports, versions


def test_patch_environment_upper_cases_stringifies_and_restores(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_T_OLD", "before")
    monkeypatch.delenv("LOCKSTEP_T_NEW", raising=False)
    with env.patch_environment(lockstep_t_old=1, LOCKSTEP_T_NEW=2.5):
        assert os.environ["LOCKSTEP_T_OLD"] == "1" and os.environ["LOCKSTEP_T_NEW"] == "2.5"
    assert os.environ["LOCKSTEP_T_OLD"] == "before" and "LOCKSTEP_T_NEW" not in os.environ


def test_patch_environment_restores_after_an_exception(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_T_FAIL", raising=False)
    with pytest.raises(KeyError), env.patch_environment(LOCKSTEP_T_FAIL="x"):
        raise KeyError("boom")
    assert "LOCKSTEP_T_FAIL" not in os.environ


def test_clear_environment_empties_then_restores_exactly(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_T_KEEP", "bar")
    before = dict(os.environ)
    with env.clear_environment():
        assert dict(os.environ) == {}
        os.environ["LOCKSTEP_T_KEEP"] = "changed"
        os.environ["LOCKSTEP_T_ADDED"] = "1"
    assert dict(os.environ) == before


@pytest.mark.parametrize(
    ("text", "value"), [("YES", 1), ("t", 1), ("On", 1), ("1", 1), ("n", 0), ("False", 0)]
)
def test_str_to_bool(text, value):
    assert env.str_to_bool(text) == value


def test_str_to_bool_and_flags_reject_other_text(monkeypatch):
    with pytest.raises(ValueError, match=r"str_to_bool\('maybe'\) is invalid"):
        env.str_to_bool("maybe")
    monkeypatch.setenv("LOCKSTEP_T_FLAG", "sometimes")
    with pytest.raises(ValueError, match=r"LOCKSTEP_T_FLAG='sometimes' is invalid"):
        env.parse_flag_from_env("LOCKSTEP_T_FLAG")


def test_flags_ints_and_choices_from_the_environment(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_T_UNSET", raising=False)
    monkeypatch.setenv("LOCKSTEP_T_ON", "true")
    monkeypatch.setenv("LOCKSTEP_T_NEG", "-1")
    monkeypatch.setenv("LOCKSTEP_T_THREE", "3")
    assert env.parse_flag_from_env("LOCKSTEP_T_ON") is True
    assert env.parse_flag_from_env("LOCKSTEP_T_UNSET", default=True) is True
    assert env.get_int_from_env(["LOCKSTEP_T_UNSET", "LOCKSTEP_T_NEG", "LOCKSTEP_T_THREE"], 9) == 3
    assert env.get_int_from_env(["LOCKSTEP_T_UNSET"], None) is None
    assert env.parse_choice_from_env("LOCKSTEP_T_ON") == "true"
    assert env.parse_choice_from_env("LOCKSTEP_T_UNSET", "bf16") == "bf16"
    monkeypatch.setenv("LOCKSTEP_T_BAD", "x")
    with pytest.raises(ValueError, match=r"LOCKSTEP_T_BAD='x' is invalid: it must be an integer"):
        env.get_int_from_env(["LOCKSTEP_T_BAD"], 0)


def test_are_libraries_initialized_lists_imported_ones():
    assert env.are_libraries_initialized("torch", "not_a_real_library_xyz") == ["torch"]


def test_convert_dict_to_env_variables_skips_unsafe_entries():
    with pytest.warns(UserWarning) as caught:
        lines = env.convert_dict_to_env_variables({"GOOD": "1", "BAD": "a b", "EMPTY": "", "ALSO": "x"})
    assert lines == ["GOOD=1\n", "ALSO=x\n"]
    assert [str(w.message).split(":")[0] for w in caught] == ["Skipping BAD='a b'", "Skipping EMPTY=''"]


def test_purge_accelerate_environment_on_functions_and_classes(monkeypatch):
    monkeypatch.setenv("ACCELERATE_T_KEPT", "old")
    monkeypatch.delenv("LOCKSTEP_T_SET", raising=False)

    @env.purge_accelerate_environment
    def configure() -> str:
        os.environ["ACCELERATE_T_KEPT"] = "new"
        os.environ["LOCKSTEP_T_SET"] = "1"
        os.environ["OTHER_T_VAR"] = "stays"
        return "done"

    assert configure() == "done"
    assert os.environ["ACCELERATE_T_KEPT"] == "old" and "LOCKSTEP_T_SET" not in os.environ
    assert os.environ.pop("OTHER_T_VAR") == "stays"  # only Accelerate's and lockstep's variables are purged

    @env.purge_accelerate_environment
    class Checks:
        def test_sets(self) -> None:
            os.environ["ACCELERATE_T_CLASS"] = "1"

    Checks().test_sets()
    assert "ACCELERATE_T_CLASS" not in os.environ
    with pytest.raises(TypeError, match="decorates a function or a class, got a int"):
        env.purge_accelerate_environment(3)


def test_cpu_distributed_information_reads_the_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    assert env.get_cpu_distributed_information() == env.CPUInformation(0, 1, 0, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert env.get_cpu_distributed_information() == env.CPUInformation(3, 4, 1, 2)


def test_cuda_p2p_check_is_true_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert env.check_cuda_p2p_ib_support() is True


def test_package_checks_find_installed_packages_without_importing_them(monkeypatch):
    monkeypatch.delitem(sys.modules, "yaml", raising=False)
    assert imports._installed("yaml") is True
    assert "yaml" not in sys.modules
    assert imports._installed("not_a_real_package_xyz") is False
    assert imports.is_numpy_available() is True
    assert imports.is_numpy_available(min_version="999.0") is False
    assert imports.is_pytest_available() is True
    assert imports.is_megatron_lm_available() is False
    assert imports.is_torch_xla_available() is False and imports.is_tpu_available() is False
    assert imports.is_transformer_engine_available() is False and imports.is_msamp_available() is False


def test_a_package_needing_a_distribution_is_not_found_from_a_stray_folder(monkeypatch, tmp_path):
    (tmp_path / "msamp").mkdir()
    (tmp_path / "msamp" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert imports._installed("msamp") is True  # the module can be found ...
    assert imports.is_msamp_available() is False  # ... but no ms-amp distribution is installed


def test_device_and_number_format_checks_on_this_machine():
    assert imports.is_torch_distributed_available() is True
    assert imports.is_cuda_available() == torch.cuda.is_available()
    assert imports.is_fp16_available() is True
    assert imports.is_weights_only_available() is True and imports.is_pippy_available() is True
    assert imports.is_npu_available() is False and imports.is_hpu_available() is False
    if not torch.cuda.is_available():
        assert imports.is_bf16_available() is True


def test_vendor_device_needs_its_plugin_and_a_device(monkeypatch):
    monkeypatch.setattr(imports, "_installed", lambda module, *names: module == "torch_npu")
    fake = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 0)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    assert imports.is_npu_available() is True
    assert imports.is_npu_available(check_device=True) is False


def test_versions_compare_like_accelerate():
    assert versions.is_torch_version(">=", "2.6") is True
    assert versions.is_torch_version("<", "2.6") is False
    assert versions.compare_versions("numpy", ">=", "1.0") is True
    assert versions.compare_versions(Version("1.2.3"), "==", "1.2.3") is True
    assert versions.compare_versions(Version("1.2.3"), "!=", "1.2.3") is False
    with pytest.raises(ValueError, match=r"operation='=>'\) is invalid: use one of '>', '>='"):
        versions.compare_versions("numpy", "=>", "1.0")
    assert str(versions.torch_version).startswith(torch.__version__.split("+")[0])


def test_fsdp_ram_efficient_loading_switches_the_variables_transformers_reads(monkeypatch):
    from lockstep.utils import disable_fsdp_ram_efficient_loading, enable_fsdp_ram_efficient_loading

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    enable_fsdp_ram_efficient_loading()
    assert os.environ["ACCELERATE_USE_FSDP"] == "True"
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "True"
    disable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "False"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # an explicit choice is kept
    enable_fsdp_ram_efficient_loading()
    assert os.environ["ACCELERATE_USE_FSDP"] == "false"
