"""`zeroqueue quantize`'s writer: an ordinary checkpoint -> a pre-quantized int8 one in int8_checkpoint.py's layout.
Apart from that module because it reads shards through the loader, which itself reads int8_checkpoint.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import read_header, read_json
from .int8_checkpoint import QUANTIZATION_CONFIG, SCALE_SUFFIX, WEIGHTS_FILE, is_layer_linear
from .loader import _read_tensors, _weight_files
from .quant import quantize_int8


def write_int8_checkpoint(src: str | Path, out: str | Path, dtype: str = "auto") -> Path:
    """The checkpoint at `src` -> a pre-quantized one at `out` (a new directory): its layers' linears quantized from
    their values in `dtype` (the dtype a replica would serve it in, so that serving `out` equals `--quantize int8`
    on `src` with that dtype), the rest saved in `dtype`; its other files copied. Returns `out`."""
    header = read_header(src, dtype)
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: quantize writes a new directory")
    torch_dtype = getattr(torch, header.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, (t, _) in _read_tensors(_weight_files(header.path)).items():
        t = t.to(torch_dtype)
        if is_layer_linear(name, t):
            q, scale = quantize_int8(t)
            tensors[name], tensors[name + SCALE_SUFFIX] = q.contiguous(), scale[:, None].contiguous()
        else:
            tensors[name] = t.contiguous()
    out.mkdir(parents=True)
    for path in header.path.iterdir():
        if path.is_file() and not path.name.startswith("model.safetensors"):
            shutil.copy2(path, out / path.name)
    config = read_json(header.path / "config.json")
    config.update(torch_dtype=header.dtype, quantization_config=QUANTIZATION_CONFIG)
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out
