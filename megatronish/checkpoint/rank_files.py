"""What ``metadata.json`` records of every file of a step (``files``), and the per-rank files a
load reads whole (RNG states, gradient compression), checked against it.

Every file a rank writes is recorded with its size in bytes and the CRC32 of each tensor that no
shard entry of ``tensors`` describes (the RNG and compression states; the model and optimizer
shards carry their CRC32 in their entries). A file read whole is refused with one
:class:`~megatronish.checkpoint.format.CheckpointError` naming it when it is missing, has
another size, is not a safetensors file or (with ``checkpoint.verify``) a tensor's CRC32 differs.

Checkpoints from before ``files`` existed record nothing: their RNG and compression files are
read unchecked (a file that cannot be read still stops the load, naming it), and
``tools/checkpoint_info.py --verify`` says that they were not verified.
"""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from megatronish.checkpoint.format import CheckpointError, Metadata, crc32_of

DAMAGED = "the checkpoint is damaged; load another step (checkpoint.resume=PATH)"


def rank_file_name(kind: str, rank: int) -> str:
    """``KIND-rankNNNNN.safetensors``: the file of ``kind`` (model, optim, rng, compression)
    that ``rank`` writes."""
    return f"{kind}-rank{rank:05d}.safetensors"


def file_record(path: str, tensors: dict[str, torch.Tensor], described: set[str]) -> dict:
    """What ``metadata.json`` records of the written file ``path`` holding ``tensors``: its size
    and the CRC32 of each tensor whose key is not in ``described`` (keys of shard entries)."""
    crcs = {k: crc32_of(t) for k, t in tensors.items() if k not in described}
    return {"bytes": os.path.getsize(path), "crc32": crcs}


def size_problem(path: str, record: dict) -> str | None:
    """Why the file at ``path`` is not the one ``record`` describes by its size, to follow the
    file's name (None: it is)."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    want = int(record.get("bytes", size))
    if size < want:
        return f"is truncated: it has {size} bytes, the save wrote {want}"
    if size > want:
        return f"was changed after the save: it has {size} bytes, the save wrote {want}"
    return None


def crc_problems(name: str, record: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Each way ``tensors`` (read from the file ``name``) differ from the CRC32s ``record``
    holds."""
    want = record.get("crc32", {})
    problems = [f"{name}: {k} is not in the file" for k in sorted(set(want) - set(tensors))]
    problems += [f"{name}: {k} was not saved" for k in sorted(set(tensors) - set(want))]
    problems += [
        f"checksum mismatch in {name} ({k}): the file is corrupt"
        for k in sorted(set(want) & set(tensors))
        if crc32_of(tensors[k]) != want[k]
    ]
    return problems


def load_whole(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``; a file that cannot be read raises a
    :class:`CheckpointError` naming it."""
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} cannot be read ({cause}): {DAMAGED}") from None


def read_rank_file(
    step_dir: str, name: str, meta: Metadata, verify: bool = True
) -> dict[str, torch.Tensor] | None:
    """The tensors of ``step_dir/name`` (a file read whole), checked against what ``meta``
    records of it (CRC32s only with ``verify``); None when it is absent and not recorded (a
    checkpoint from before the file existed). Damage raises one :class:`CheckpointError`
    naming the file."""
    path = os.path.join(step_dir, name)
    record = meta.files.get(name)
    if not os.path.exists(path):
        if record is None:
            return None
        raise CheckpointError(f"{path} is missing (the save wrote it): {DAMAGED}")
    if record is not None and (problem := size_problem(path, record)) is not None:
        raise CheckpointError(f"{path} {problem}: {DAMAGED}")
    tensors = load_whole(path)
    if record is not None and verify and (problems := crc_problems(path, record, tensors)):
        raise CheckpointError(f"{problems[0]}; {DAMAGED}")
    return tensors
