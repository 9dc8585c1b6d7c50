#!/usr/bin/env python3
"""Our chunked Gated DeltaNet prefill against flash-linear-attention's chunk_gated_delta_rule on one GPU.

Shape of Qwen3.8-Flash-Next: batch 1, 48 value heads on 16 key heads (fla's GVA), dk = dv = 128, T = 512 and 8192.

- Timing: ours through `vavilov_gdn_bench prefill` (l2 norms, gates, the chunk kernels and the gated RMS norm) at
  each of --precisions: fp32 (3×TF32 tensor cores, fp32 accuracy), tf32 (one TF32 pass a product) and bf16 (bf16
  operands and a bf16 scratch, fp32 state: fla's arithmetic class), the bench run with VAVILOV_GEMM_PRECISION set to
  it; fla in float32 (Triton's tl.dot on fp32 inputs: TF32 tensor cores) and bfloat16 inputs, with
  use_qk_l2norm_in_kernel and precomputed g, beta (their computation is left out of fla's time). Median of CUDA-event
  timings after warm-up (Triton compiles and autotunes in the warm-up). fla's Python wrapper launches several Triton
  kernels a call, so an eager call's time can be the host's, not the GPU's: --fla-timers adds the mean of calls
  enqueued back to back and the median of CUDA-graph replays, and --rounds N times ours and fla N more times,
  alternating, at T = 8192. --fla-core adds fla doing all of our pass's work (fla_core_bf16: its in-kernel gates and
  l2 norms, the rule, then its fused gated RMS norm with the sigmoid gate), the like-for-like comparison.
- Agreement: on the same random inputs (zero initial state), ours at each precision (`vavilov_gdn_bench check`), fla
  and a float64 recurrence of the spec (torch, token by token): the gated, normalised outputs and the final state.

Needs torch and triton (the GPU machine's image) plus fla-core==0.6.0 and einops==0.8.2 (its only pure-python
import). The GPU machine has no internet: fetch the wheels elsewhere with
`pip download --no-deps fla-core==0.6.0 einops==0.8.2`, then `pip install --no-deps --target DIR *.whl` there and put
DIR on PYTHONPATH. fla compiles and autotunes each dtype on first use (over a minute on the H200).

Usage: gdn_vs_fla.py --bench BUILD/vavilov_gdn_bench --out RESULT.json [--commit C] [--budget-s S] [--bf16-only]
                     [--precisions fp32 tf32 bf16] [--fla-timers eager back_to_back graph] [--rounds N]
                     [--fla-kernels] [--fla-core]
(--bf16-only: fla with bf16 inputs only, its agreement check included; fp32 inputs compile and autotune for minutes)
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import tempfile
import time

import torch

H, HV, D = 16, 48, 128
EPS = 1e-6


def random_inputs(t, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(t, H, D, generator=gen),
        "k": torch.randn(t, H, D, generator=gen),
        "v": torch.randn(t, HV, D, generator=gen),
        "b": 2 * torch.randn(t, HV, generator=gen),
        "a": 2 * torch.randn(t, HV, generator=gen),
        "a_log": -1 + 3.5 * torch.rand(HV, generator=gen),
        "dt_bias": torch.randn(HV, generator=gen),
        "z": torch.randn(t, HV, D, generator=gen),
        "norm": 0.5 + torch.rand(D, generator=gen),
    }


def gates(x):
    g = -torch.exp(x["a_log"].double()) * torch.nn.functional.softplus(x["a"].double() + x["dt_bias"].double())
    return g, torch.sigmoid(x["b"].double())


def gated_norm(o, x):
    o = o.double()
    z = x["z"].double().to(o.device)
    return x["norm"].double().to(o.device) * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS) * torch.sigmoid(z)


def reference(x, device):
    """float64 recurrence, token by token: S ← e^g S; δ = β(v − Sᵀk); S ← S + kδᵀ; o = Sᵀq."""
    q, k, v = (x[n].double().to(device) for n in ("q", "k", "v"))
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(D)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(HV // H, dim=1), k.repeat_interleave(HV // H, dim=1)
    g, beta = (y.to(device) for y in gates(x))
    state = torch.zeros(HV, D, D, dtype=torch.float64, device=device)
    out = torch.empty(q.shape[0], HV, D, dtype=torch.float64, device=device)
    for t in range(q.shape[0]):
        state *= torch.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hij,hi->hj", state, k[t]))
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hij,hi->hj", state, q[t])
    return gated_norm(out, x), state


def with_precision(precision):
    """The environment our bench runs in: VAVILOV_GEMM_PRECISION picks the prefill's products."""
    return dict(os.environ, VAVILOV_GEMM_PRECISION=precision)


def run_ours(bench, x, t, precision):
    with tempfile.TemporaryDirectory() as d:
        qkv = torch.cat([x["q"].reshape(t, -1), x["k"].reshape(t, -1), x["v"].reshape(t, -1)], dim=1)
        for name, tensor in {"qkv": qkv, "b": x["b"], "a": x["a"], "a_log": x["a_log"], "dt_bias": x["dt_bias"],
                             "z": x["z"], "norm": x["norm"]}.items():
            tensor.contiguous().float().numpy().tofile(os.path.join(d, name + ".f32"))
        subprocess.run([bench, "check", d, str(t)], check=True, env=with_precision(precision))
        out = torch.from_file(os.path.join(d, "ours_out.f32"), size=t * HV * D, dtype=torch.float32)
        state = torch.from_file(os.path.join(d, "ours_state.f32"), size=HV * D * D, dtype=torch.float32)
        return out.reshape(t, HV, D).clone(), state.reshape(HV, D, D).clone()


def fla_call(fla, x, dtype, device):
    g, beta = gates(x)
    q, k, v, beta = (a.to(device=device, dtype=dtype).unsqueeze(0).contiguous() for a in (x["q"], x["k"], x["v"], beta))
    g = g.to(device=device, dtype=torch.float32).unsqueeze(0).contiguous()  # log decays stay fp32
    return lambda: fla(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)


def fla_core_call(fla, x, device):
    """fla doing all the work ours does, bf16: the gates (use_gate_in_kernel: −e^{A_log} softplus(a + dt_bias) and the
    chunk cumsum; use_beta_sigmoid_in_kernel), the l2 norms, the chunked rule, then fla's own gated RMS norm
    (rms_norm_gated with the sigmoid gate) on its output. Returns (gated normalised output, final state)."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    q, k, v, z = (x[n].to(device=device, dtype=torch.bfloat16).unsqueeze(0).contiguous() for n in ("q", "k", "v", "z"))
    a, b = (x[n].to(device=device, dtype=torch.float32).unsqueeze(0).contiguous() for n in ("a", "b"))
    a_log, dt_bias, weight = (x[n].to(device=device, dtype=torch.float32) for n in ("a_log", "dt_bias", "norm"))

    def call():
        o, state = fla(q, k, v, a, b, use_qk_l2norm_in_kernel=True, output_final_state=True, use_gate_in_kernel=True,
                       A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        return rms_norm_gated(o, z, weight, None, activation="sigmoid", eps=EPS), state

    return call


def median_us(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    times.sort()
    return times[len(times) // 2]


def back_to_back_us(fn, warmup, repeats):
    """Mean time of `repeats` calls enqueued between two events: the host's launch overhead overlaps the GPU's work
    wherever the GPU is the slower of the two, so this is the GPU time of a GPU-bound call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / repeats


def graph_us(fn, warmup, repeats):
    """Median time of one call replayed from a CUDA graph (no host launch overhead at all)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the capture's allocations come from a warmed pool
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_us(graph.replay, warmup, repeats)


FLA_TIMERS = {"eager": median_us, "back_to_back": back_to_back_us, "graph": graph_us}


def kernel_times_us(fn, calls):
    """GPU time per kernel name of one call (torch.profiler's CUDA activity over `calls` calls, averaged): which of
    fla's kernels its time goes to."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in trace.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:
            total = event.cuda_time_total
        if total > 0:
            times[event.key] = total / calls
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def relative_error(got, want):
    got, want = got.double().to(want.device), want
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench", required=True, help="the vavilov_gdn_bench binary")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--budget-s", type=float, default=110.0, help="skip what is left after this many seconds")
    parser.add_argument("--bf16-only", action="store_true", help="run fla with bf16 inputs only")
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "tf32", "bf16"],
                        help="our prefill's products: fp32 (3×TF32, the default), tf32 (one pass), bf16 (bf16 "
                             "operands and scratch)")
    parser.add_argument("--fla-timers", nargs="+", default=["eager"], choices=sorted(FLA_TIMERS),
                        help="how fla is timed: eager (median of single calls between events, the host's Python "
                             "launch overhead included), back_to_back (mean of calls enqueued together), graph "
                             "(median of CUDA-graph replays)")
    parser.add_argument("--fla-kernels", action="store_true",
                        help="fla's GPU time per kernel at T = 8192 (torch.profiler), after the timings")
    parser.add_argument("--fla-core", action="store_true",
                        help="also time fla doing all of our pass's work in bf16 (gates and l2 norms in its kernels, "
                             "the rule, its fused gated RMS norm: fla_core_bf16) and check it against float64")
    parser.add_argument("--rounds", type=int, default=0,
                        help="time ours and fla this many times, alternating, at T = 8192 (drift between runs)")
    args = parser.parse_args()
    begin = time.time()
    device = torch.device("cuda")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": torch.cuda.get_device_name(0),
        "commit": args.commit,
        "torch": torch.__version__,
        "shape": {"batch": 1, "value_heads": HV, "key_heads": H, "dk": D, "dv": D},
        "ours": "vavilov_gdn_bench: ours_fp32 3×TF32 tensor cores (fp32 accuracy), ours_tf32 one TF32 pass a product, "
                "ours_bf16 bf16 operands (m16n8k16) and a bf16 scratch with the state in fp32; "
                "gates and l2 norms in the kernels, gated RMS norm included",
        "fla": "chunk_gated_delta_rule(use_qk_l2norm_in_kernel=True, output_final_state=True), g and beta precomputed; "
               "no gated norm",
        "timings_us": {},
        "agreement": {},
        "skipped": [],
    }
    try:
        import triton

        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        import fla

        result["triton"], result["fla_version"] = triton.__version__, fla.__version__
    except Exception as error:  # noqa: BLE001 - the result says why fla is missing
        chunk_gated_delta_rule = None
        result["fla_error"] = repr(error)

    def ours_prefill_times(precision):
        """T → µs of one `vavilov_gdn_bench prefill` run (its whole JSON kept under ours_kernels)."""
        ours_json = args.out + ".ours.json"
        subprocess.run([args.bench, "prefill", ours_json], check=True, env=with_precision(precision))
        with open(ours_json) as f:
            ours = json.load(f)
        os.remove(ours_json)
        result["ours_kernels"][precision] = ours
        return {p["T"]: p["us"] for p in ours["prefill"]}

    result["ours_kernels"] = {}
    ours_prefill = {precision: ours_prefill_times(precision) for precision in args.precisions}  # precision → T → µs

    fla_dtype, fla_name = (torch.bfloat16, "fla_bf16") if args.bf16_only else (torch.float32, "fla_fp32")

    def agreement(t, with_fla):
        if time.time() - begin > args.budget_s:
            result["skipped"].append(f"agreement T={t}: over the time budget")
            return
        print(f"[{time.time() - begin:.1f} s] agreement T={t}", flush=True)
        x = random_inputs(t, 2)
        want_out, want_state = reference(x, device)
        entry, ours_out = {}, {}
        for precision in args.precisions:
            got_out, got_state = run_ours(args.bench, x, t, precision)
            entry[f"ours_{precision}_vs_float64"] = {"out": relative_error(got_out, want_out),
                                                     "state": relative_error(got_state, want_state)}
            ours_out[precision] = got_out
        if with_fla and chunk_gated_delta_rule is not None:
            try:
                o, state = fla_call(chunk_gated_delta_rule, x, fla_dtype, device)()
                fla_out = gated_norm(o[0], x)
                entry[fla_name + "_vs_float64"] = {"out": relative_error(fla_out, want_out),
                                                   "state": relative_error(state[0], want_state)}
                for precision, got_out in ours_out.items():
                    entry[f"ours_{precision}_vs_{fla_name}"] = {"out": relative_error(got_out, fla_out)}
            except Exception as error:  # noqa: BLE001 - recorded in the result
                entry["fla_error"] = repr(error)
        if with_fla and args.fla_core and chunk_gated_delta_rule is not None:
            try:
                core_out, core_state = fla_core_call(chunk_gated_delta_rule, x, device)()
                entry["fla_core_bf16_vs_float64"] = {"out": relative_error(core_out[0], want_out),
                                                     "state": relative_error(core_state[0], want_state)}
            except Exception as error:  # noqa: BLE001 - recorded in the result
                entry["fla_core_error"] = repr(error)
        entry["metric"] = "max |x − ref| / max(1, max |ref|) over the gated normalised outputs / the final state"
        result["agreement"][str(t)] = entry
        print(t, entry, flush=True)

    def save():
        result["seconds"] = time.time() - begin
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def fla_timing(t, dtype, name):
        timing = result["timings_us"].setdefault(
            str(t), {f"ours_{precision}": ours_prefill[precision].get(t) for precision in args.precisions})
        if chunk_gated_delta_rule is None:
            return
        if time.time() - begin > args.budget_s:
            result["skipped"].append(f"{name} T={t}: over the time budget")
            return
        print(f"[{time.time() - begin:.1f} s] {name} T={t}", flush=True)
        try:
            calls = {name: fla_call(chunk_gated_delta_rule, random_inputs(t, 1), dtype, device)}
            if args.fla_core and dtype == torch.bfloat16:
                calls["fla_core_bf16"] = fla_core_call(chunk_gated_delta_rule, random_inputs(t, 1), device)
        except Exception as error:  # noqa: BLE001 - recorded in the result
            timing[name + "_error"] = repr(error)
            calls = {}
        for label, call in calls.items():
            for timer in args.fla_timers:
                key = label if timer == "eager" else f"{label}_{timer}"
                try:
                    timing[key] = FLA_TIMERS[timer](call, 3, 20)
                except Exception as error:  # noqa: BLE001 - recorded in the result (e.g. a graph capture refused)
                    timing[key + "_error"] = repr(error)
                    continue
                for precision in args.precisions:
                    timing[f"{label}_over_ours_{precision}_{timer}"] = timing[key] / timing[f"ours_{precision}"]
        print(t, timing, flush=True)

    def rounds(fla_dtype_and_name):
        """Ours (every precision) and fla (every timer) again, alternating, at T = 8192."""
        if args.rounds < 1 or chunk_gated_delta_rule is None:
            return
        dtype, name = fla_dtype_and_name
        calls = {name: fla_call(chunk_gated_delta_rule, random_inputs(8192, 1), dtype, device)}
        if args.fla_core and dtype == torch.bfloat16:
            calls["fla_core_bf16"] = fla_core_call(chunk_gated_delta_rule, random_inputs(8192, 1), device)
        series = result.setdefault("rounds_8192_us", [])
        for r in range(args.rounds):
            if time.time() - begin > args.budget_s:
                result["skipped"].append(f"round {r}: over the time budget")
                return
            entry = {f"ours_{p}": ours_prefill_times(p)[8192] for p in args.precisions}
            for label, call in calls.items():
                for timer in args.fla_timers:
                    key = label if timer == "eager" else f"{label}_{timer}"
                    try:
                        entry[key] = FLA_TIMERS[timer](call, 3, 20)
                    except Exception as error:  # noqa: BLE001 - recorded in the result
                        entry[key + "_error"] = repr(error)
            series.append(entry)
            print("round", r, entry, flush=True)
            save()

    # Each stage saves what it has: a run cut short still leaves its results.
    # fla compiles and autotunes per dtype on first use (tens of seconds): bf16, its fastest path, first.
    save()
    agreement(512, with_fla=False)
    save()
    dtypes = ((torch.bfloat16, "fla_bf16"),) if args.bf16_only else ((torch.bfloat16, "fla_bf16"),
                                                                     (torch.float32, "fla_fp32_inputs"))
    for dtype, name in dtypes:
        for t in (512, 8192):
            fla_timing(t, dtype, name)
            save()
    rounds(dtypes[0])
    save()
    if args.fla_kernels and chunk_gated_delta_rule is not None and time.time() - begin < args.budget_s:
        dtype, name = dtypes[0]
        kernels = kernel_times_us(fla_call(chunk_gated_delta_rule, random_inputs(8192, 1), dtype, device), 5)
        result[f"{name}_kernels_8192_us"] = kernels
        for kernel, us in kernels.items():
            print("fla kernel", f"{us:9.1f} us", kernel[:100], flush=True)
        save()
    agreement(512, with_fla=True)
    save()
    agreement(8192, with_fla=True)
    save()


if __name__ == "__main__":
    main()
