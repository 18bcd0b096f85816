"""The TF32 setting against both generations of torch's switches, and torch's own; the
deterministic mode.

torch < 2.9 has only ``allow_tf32``; torch >= 2.9 keeps one state behind the legacy and the new
(``fp32_precision``) switches, and a legacy reader raises when the two disagree. The fakes
below follow ``aten/src/ATen/Context.cpp`` (allowTF32CuBLAS, float32MatmulPrecision,
allowTF32CuDNN, setAllowTF32CuBLAS, setAllowTF32CuDNN, float32Precision).
"""

import os
import subprocess
import sys

import pytest
import torch

from megatronish.model.rms_norm import TORCH_VERSION
from megatronish.training.peaks import tf32_matmuls
from megatronish.training.precision import (
    apply_deterministic,
    set_fp32_precision,
    tf32_matmuls_enabled,
)

MIXED = "mix of the legacy and new APIs"


class _Switches:
    """A module of named switches; an unknown name raises AttributeError, as torch's do."""

    def __init__(self, get, set_):
        object.__setattr__(self, "_get", get)
        object.__setattr__(self, "_set", set_)

    def __getattr__(self, name):
        return self._get(name)

    def __setattr__(self, name, value):
        self._set(name, value)


def _unknown(name, *_):
    raise AttributeError(f"Unknown attribute {name}")


class LegacyTorch:
    """torch 2.6 - 2.8: ``allow_tf32`` only."""

    def __init__(self):
        state = {"matmul": False, "cudnn": True}

        def switch(key):
            def get(name):
                return state[key] if name == "allow_tf32" else _unknown(name)

            def set_(name, value):
                if name != "allow_tf32":
                    _unknown(name)
                state[key] = value

            return _Switches(get, set_)

        self.state = state
        self.cuda = _Switches({"matmul": switch("matmul")}.__getitem__, _unknown)
        self.cudnn = switch("cudnn")

    def legacy_readers(self):
        return self.cuda.matmul.allow_tf32, self.cudnn.allow_tf32


class SplitTorch:
    """torch >= 2.9: a legacy and a new view of one state; legacy readers check agreement."""

    def __init__(self):
        self.legacy_matmul = "highest"  # float32_matmul_precision
        self.legacy_cudnn = True  # allow_tf32_cudnn
        self.new = {
            "matmul": "none",
            "conv": "tf32",
            "rnn": "tf32",
            "cuda": "none",
            "generic": "none",
        }

        def resolve(op):
            for key in (op, "cuda", "generic"):
                if self.new[key] != "none":
                    return self.new[key]
            return "none"

        def matmul_get(name):
            if name == "fp32_precision":
                return self.new["matmul"]
            if name == "allow_tf32":
                tf32 = resolve("matmul") == "tf32"
                if (self.legacy_matmul != "highest") != tf32:
                    raise RuntimeError(f"allow_tf32_new for cuBlas matmul: {MIXED}")
                return tf32
            return _unknown(name)

        def matmul_set(name, value):
            if name == "fp32_precision":
                self.new["matmul"] = value
            elif name == "allow_tf32":
                self.legacy_matmul = "high" if value else "highest"
                self.new["matmul"] = "tf32" if value else "ieee"
            else:
                _unknown(name)

        def cudnn_get(name):
            if name == "fp32_precision":
                return self.new["cuda"]
            if name == "conv":
                return _Switches(lambda n: self.new["conv"], self._set_conv)
            if name == "allow_tf32":
                conv, rnn = resolve("conv") == "tf32", resolve("rnn") == "tf32"
                if not conv == rnn == self.legacy_cudnn:
                    raise RuntimeError(f"allow_tf32 for cuDNN: {MIXED}")
                return self.legacy_cudnn
            return _unknown(name)

        def cudnn_set(name, value):
            if name != "allow_tf32":
                _unknown(name)
            self.new["conv"] = self.new["rnn"] = "tf32" if value else "none"
            self.legacy_cudnn = value

        self.cuda = _Switches({"matmul": _Switches(matmul_get, matmul_set)}.__getitem__, _unknown)
        self.cudnn = _Switches(cudnn_get, cudnn_set)
        self.fp32_precision = "none"

    def _set_conv(self, name, value):
        self.new["conv"] = value

    def get_float32_matmul_precision(self):
        if self.new["matmul"] == "tf32" and self.legacy_matmul == "highest":
            raise RuntimeError(f"matmul precision without a backend name: {MIXED}")
        return self.legacy_matmul

    def legacy_readers(self):
        return (
            self.get_float32_matmul_precision(),
            self.cuda.matmul.allow_tf32,
            self.cudnn.allow_tf32,
        )


def test_the_split_fake_raises_like_torch_when_only_the_new_switch_is_written():
    fake = SplitTorch()
    fake.cuda.matmul.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match=MIXED):
        fake.get_float32_matmul_precision()
    with pytest.raises(RuntimeError, match=MIXED):
        _ = fake.cuda.matmul.allow_tf32
    assert tf32_matmuls_enabled(fake)  # our reader never goes through a legacy one


@pytest.mark.parametrize("torch_kind", [LegacyTorch, SplitTorch])
@pytest.mark.parametrize("setting", ["tf32", "ieee"])
def test_the_setting_reaches_every_switch_and_every_reader_agrees(torch_kind, setting):
    fake = torch_kind()
    set_fp32_precision(setting, fake)
    tf32 = setting == "tf32"
    readers = fake.legacy_readers()  # none raises
    assert readers[-2:] == (tf32, tf32)
    assert tf32_matmuls_enabled(fake) == tf32
    if torch_kind is SplitTorch:
        assert readers[0] == ("high" if tf32 else "highest")
        assert fake.cuda.matmul.fp32_precision == fake.cudnn.conv.fp32_precision == setting
    else:
        assert fake.state == {"matmul": tf32, "cudnn": tf32}


@pytest.mark.skipif(
    TORCH_VERSION < (2, 9),
    reason="torch < 2.9 has no fp32_precision switches (AttributeError): only the fakes apply",
)
def test_this_torch_keeps_legacy_readers_working_after_the_setting():
    """torch.compile reads torch.get_float32_matmul_precision(); on this torch it must not raise
    after the run set the precision (it raised when only the new switch was written), and the
    MFU peak reads the setting whoever wrote it."""
    b = torch.backends
    saved = (
        b.cuda.matmul.allow_tf32,
        b.cudnn.allow_tf32,
        b.cuda.matmul.fp32_precision,
        b.cudnn.conv.fp32_precision,
        b.cudnn.rnn.fp32_precision,
        b.mkldnn.matmul.fp32_precision,
    )
    try:
        for setting, legacy in (("tf32", "high"), ("ieee", "highest")):
            set_fp32_precision(setting)
            assert torch.get_float32_matmul_precision() == legacy
            assert b.cuda.matmul.allow_tf32 == b.cudnn.allow_tf32 == (setting == "tf32")
            assert tf32_matmuls_enabled() == (setting == "tf32")
        # Other code mixes the generations: the legacy reader answers wrong, or raises; ours
        # reads the switch cuBLAS obeys.
        torch.set_float32_matmul_precision("high")
        b.cuda.matmul.fp32_precision = "ieee"
        assert torch.get_float32_matmul_precision() == "high" and not tf32_matmuls()
        b.cuda.matmul.allow_tf32 = False
        b.mkldnn.matmul.fp32_precision = "bf16"
        with pytest.raises(RuntimeError, match=MIXED):
            torch.get_float32_matmul_precision()
        assert not tf32_matmuls()
    finally:
        b.mkldnn.matmul.fp32_precision = saved[5]
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = saved[:2]
        b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision = saved[2:4]
        b.cudnn.rnn.fp32_precision = saved[4]


def test_deterministic_mode_switches_on_and_back_off(monkeypatch):
    """On: torch's deterministic kernels, a fixed cuBLAS workspace, no NaN-filling of every
    torch.empty; off again: torch's defaults, the workspace variable removed (one the user set
    is kept)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    fill = torch.utils.deterministic
    apply_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled() and fill.fill_uninitialized_memory
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    try:
        apply_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # cuDNN SDPA excluded
        assert not fill.fill_uninitialized_memory
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        apply_deterministic(False)
        assert not torch.are_deterministic_algorithms_enabled() and fill.fill_uninitialized_memory
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own
        apply_deterministic(True)
        apply_deterministic(False)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)
        fill.fill_uninitialized_memory = True


def test_the_default_mode_costs_no_compiler_import():
    """Neither the entry point's imports nor ``trainer.deterministic=false`` (the default) import
    torch._inductor or torch._dynamo (about 800 modules, seconds at every rank's start-up):
    calling ``torch.use_deterministic_algorithms`` at all imports both, and so does
    ``torch.compiler.disable`` (the collectives use torch's lazy form of it)."""
    code = (
        "import sys; import megatronish.train, megatronish.training.job, "
        "megatronish.training.trainer; "
        "from megatronish.training.precision import apply_deterministic; "
        "apply_deterministic(False); "
        "print(sorted(m for m in ('torch._inductor', 'torch._dynamo') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
