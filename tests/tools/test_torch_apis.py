"""The torch APIs the GPU check and the CUDA paths call (tools/gpu_check/torch_apis.py): each is
in the installed torch with the parameters we pass; every one newer than the pyproject floor is
feature-detected (or a listed floor gap); every one newer than the GPU machine's torch 2.11 is
called through a detector, which given 2.11's (and 2.10's) varlen signature calls it in the
form that torch takes and still pairs the grouped heads as SDPA does."""

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_check import documents
from gpu_check.torch_apis import APIS, FLOOR_GAPS, GPU_MACHINE_TORCH, OLDEST_READ

from megatronish.model import linear_cross_entropy, rms_norm
from megatronish.moe.grouped_mm import use_grouped_mm

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


def resolve(name: str):
    """The object a dotted name from ``torch`` names (importing submodules on the way)."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i]))
    return obj


def parameter_names(obj) -> set[str]:
    """Parameter names of a Python callable, an operator overload's schema, or (for a builtin
    without a Python signature) its ATen operator's overloads."""
    if hasattr(obj, "_schema"):
        return {a.name for a in obj._schema.arguments}
    try:
        return set(inspect.signature(obj).parameters)
    except ValueError:
        packet = getattr(torch.ops.aten, obj.__name__)
        return {a.name for o in packet.overloads() for a in getattr(packet, o)._schema.arguments}


def floor() -> tuple[int, int]:
    text = (ROOT / "pyproject.toml").read_text()
    major, minor = re.search(r'"torch>=(\d+)\.(\d+)', text).groups()
    return int(major), int(minor)


@pytest.mark.parametrize("api", APIS, ids=lambda a: f"{a.name}{list(a.params) or ''}")
def test_each_api_is_in_this_torch_with_the_parameters_we_pass(api):
    assert OLDEST_READ <= api.since <= INSTALLED
    obj = resolve(api.name)
    if api.params:
        assert set(api.params) <= parameter_names(obj)


def test_each_detector_named_exists():
    for api in APIS:
        if api.detector:
            module, attribute = api.detector.split(":")
            assert hasattr(importlib.import_module(module), attribute), api.detector


def test_the_floor_covers_every_api_called_without_a_detector():
    newer = {a.name for a in APIS if a.since > floor() and a.detector is None}
    assert floor() >= OLDEST_READ
    assert newer == set(FLOOR_GAPS)  # a new gap is listed (and reported), a fixed one removed


def test_every_api_newer_than_the_gpu_machines_torch_is_detected():
    newer = [a for a in APIS if a.since > GPU_MACHINE_TORCH]
    assert newer and all(a.detector for a in newer)
    assert {a.detector for a in newer} == {documents.varlen_call.__module__ + ":varlen_call"}


def test_the_detectors_thresholds_are_the_listed_releases():
    since = {a.detector: a.since for a in APIS if a.detector}
    grouped = since["megatronish.moe.grouped_mm:use_grouped_mm"]
    before = (grouped[0], grouped[1] - 1)
    assert use_grouped_mm("cuda", torch.bfloat16, grouped, (9, 0))
    assert not use_grouped_mm("cuda", torch.bfloat16, before, (9, 0))
    assert rms_norm.FUSED_CUDA_RMS_NORM == since["megatronish.model.rms_norm:fused_backward_on"]
    has_mm_dtype = "dtype" in torch.ops.aten.mm.overloads()
    assert linear_cross_entropy.HAS_FP32_OUTPUT_MM == has_mm_dtype


# -- varlen_attn in the shapes torch 2.10, 2.11 and 2.12 give it -------------------------------
class Recorder:
    """A varlen_attn that attends causally within each document with SDPA (the flash kernel's
    rule: as many K/V heads as query heads unless ``enable_gqa``) and records its keywords."""

    def __init__(self):
        self.calls = []

    def attend(self, q, k, v, cu, causal: bool, gqa: bool = False):
        self.calls.append({"kv_heads": k.shape[1], "causal": causal, "gqa": gqa})
        if k.shape[1] != q.shape[1] and not gqa:
            raise RuntimeError("number of heads in key/value must equal the query's")
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            x = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            outs.append(F.scaled_dot_product_attention(*x, is_causal=causal, enable_gqa=gqa))
        return torch.cat(outs, dim=2)[0].transpose(0, 1)


def varlen_2_10(recorder):
    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None
    ):
        return recorder.attend(query, key, value, cu_seq_q, is_causal)

    return varlen_attn


def varlen_2_11(recorder):
    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
    ):
        return recorder.attend(query, key, value, cu_seq_q, window_size == (-1, 0))

    return varlen_attn


def varlen_2_12(recorder):
    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        return recorder.attend(query, key, value, cu_seq_q, window_size == (-1, 0), enable_gqa)

    return varlen_attn


def _core():
    from gpu_check.context import CheckContext

    return documents.Core(CheckContext(torch.device("cpu"), True, 60.0))


@pytest.mark.parametrize(
    "shape, gqa", [(varlen_2_10, False), (varlen_2_11, False), (varlen_2_12, True)]
)
def test_varlen_is_called_as_each_torch_takes_it_and_equals_each_document_alone(shape, gqa):
    core, recorder = _core(), Recorder()
    run = core.varlen(shape(recorder))
    try:
        got = run()
    except (TypeError, RuntimeError) as e:  # a keyword this torch lacks, or ungrouped heads
        pytest.fail(f"varlen_attn called in a form this torch does not take: {e}")
    (call,) = recorder.calls
    assert call == {"kv_heads": core.kv if gqa else core.heads, "causal": True, "gqa": gqa}
    with torch.no_grad():
        want = core.per_document()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_varlen_without_a_causal_form_is_not_called():
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("called")

    assert documents.varlen_call(varlen_attn) is None
    assert _core().varlen(varlen_attn) is None
