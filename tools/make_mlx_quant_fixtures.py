#!/usr/bin/env python3
"""Reference fixtures for MLX affine quantization, made by `mlx` itself (the PyPI package, CPU backend).

Cases: bf16 and f32 inputs; 4/3/2 bits at groups 32/64/128; 8/6/5 bits at group 64.

Usage:
    python3 tools/make_mlx_quant_fixtures.py --out tests/fixtures/mlx_quant

Writes cases.safetensors with, for every case NAME (input dtype x bits x group size):
  NAME.w        the input rows [rows, cols] (BF16 or F32), random normal with special groups mixed in
                (constant, all zero, all positive, all negative, one outlier, tiny values)
  NAME.q        mx.quantize codes, uint32 words [rows, cols*bits/32]
  NAME.scales   mx.quantize scales [rows, cols/group] in the input dtype
  NAME.biases   mx.quantize biases, likewise
  NAME.deq      mx.dequantize of (q, scales, biases) with scales and biases widened to float32 (exact), float32
and for the group-64 cases also
  NAME.x        inputs [4, cols] float32
  NAME.y        x @ deq.T computed in float64 by numpy, stored as float32 [4, rows]
The C++ tests (tests/test_mlx_quant.cpp) compare our quantizer and dequantizer bit for bit and our matrix products
within a stated tolerance; they need neither mlx nor numpy at test time.
"""
from __future__ import annotations

import argparse
import os

import mlx.core as mx
import numpy as np
import torch
from safetensors.torch import save_file

ROWS = 6
COLS = 256


def special_rows(rng: np.random.Generator, cols: int, group: int) -> np.ndarray:
    """Random normal rows whose groups include the corner cases of MLX's scale/bias choice."""
    w = rng.standard_normal((ROWS, cols)).astype(np.float32)
    groups = w.reshape(ROWS, cols // group, group)
    groups[0, 0] = 0.0  # all zero: scale falls to eps, q0 = 0
    groups[0, 1] = 0.37  # constant: max == min
    groups[1, 0] = np.abs(groups[1, 0]) + 0.5  # all positive
    groups[1, 1] = -np.abs(groups[1, 1]) - 0.5  # all negative
    groups[2, 0, 5] = 40.0  # one large positive outlier
    groups[2, 1, 7] = -40.0  # one large negative outlier
    groups[3] *= 1e-3  # tiny values
    groups[4, 0] = np.linspace(-1.0, 1.0, group)  # symmetric ramp: many exact ties between levels
    return groups.reshape(ROWS, cols)


def to_torch(a: mx.array) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def make_case(rng, dtype, bits, group, out):
    name = f"{'bf16' if dtype == mx.bfloat16 else 'f32'}_b{bits}_g{group}"
    w = mx.array(special_rows(rng, COLS, group)).astype(dtype)
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    deq = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits)
    out[f"{name}.w"] = to_torch(w)
    out[f"{name}.q"] = to_torch(q)
    out[f"{name}.scales"] = to_torch(scales)
    out[f"{name}.biases"] = to_torch(biases)
    out[f"{name}.deq"] = to_torch(deq)
    if group == 64:
        x = rng.standard_normal((4, COLS)).astype(np.float32)
        y = x.astype(np.float64) @ np.array(deq).astype(np.float64).T
        out[f"{name}.x"] = torch.from_numpy(x)
        out[f"{name}.y"] = torch.from_numpy(y.astype(np.float32))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=9)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(args.seed)
    out: dict[str, torch.Tensor] = {}
    for dtype in (mx.bfloat16, mx.float32):
        for bits in (4, 3, 2):
            for group in (32, 64, 128):
                make_case(rng, dtype, bits, group, out)
        for bits in (8, 6, 5):  # MLX's other affine widths, read (slowly) from checkpoints that use them
            make_case(rng, dtype, bits, 64, out)
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(args.out, "cases.safetensors"),
              metadata={"mlx": mx.__version__})
    print(f"wrote {len(out)} tensors (mlx {mx.__version__}) to {args.out}/cases.safetensors")


if __name__ == "__main__":
    main()
