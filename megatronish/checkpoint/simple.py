"""Final-weights export: one safetensors file of global tensors per pipeline stage."""

from __future__ import annotations

import json
import os

from safetensors.torch import save_file
from torch import nn

from megatronish.checkpoint.gather import gather_tp_params
from megatronish.distributed.topology import Topology


def save_final_weights(chunks: list[nn.Module], topo: Topology, out_dir: str, step: int, cfg_dict):
    """Write ``out_dir/step_XXXXXXX/model-ppNN.safetensors`` (+ metadata.json on rank 0).

    Collective over tp; written by tp rank 0 of dp rank 0 of every stage. Returns the directory.
    """
    tensors = gather_tp_params(chunks, topo)
    step_dir = os.path.join(out_dir, f"step_{step:07d}")
    if topo.coords.dp == 0 and topo.coords.tp == 0:
        os.makedirs(step_dir, exist_ok=True)
        path = os.path.join(step_dir, f"model-pp{topo.coords.pp:02d}.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        if topo.rank == 0:
            meta = {"format": "megatronish-weights", "version": 1, "step": step, "config": cfg_dict}
            with open(os.path.join(step_dir, "metadata.json"), "w") as f:
                json.dump(meta, f, indent=1)
    return step_dir
