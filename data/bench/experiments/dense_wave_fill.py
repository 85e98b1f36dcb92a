"""How much of the dense forward's gap to cuDNN is the persistent grid's last wave (CPU, from a bench JSON).

    python data/bench/experiments/dense_wave_fill.py ../dense_speed_h200_20261202_d2b896c.json [SMS]

For each dense record (``dense_<tokens>``, 128-row items, one per Q block and head, ``SMS`` CTAs, 132 by
default: the H100 SXM's and the H200's SM count): the items, the waves they make (items / CTAs), the last
wave's fill (waves / ⌈waves⌉: every item streams the same keys, so the CTAs idle for the rest of the last
wave), KPage's physical TFLOP/s and the same per busy SM (divided by the fill), and cuDNN's rate.
"""

import json
import math
import sys


def main(path: str, sms: int = 132) -> None:
    with open(path) as f:
        run = json.load(f)
    print(f"{path}: {run.get('gpu')}, {run.get('commit')}")
    rates = {}
    for r in run["records"]:
        if r.get("pass") == "fwd" and "time_ms" in r and r["workload"].startswith("dense_"):
            pairs = r.get("physical_pairs") or r.get("useful_pairs")
            rates[(r["workload"], r["impl"])] = (r, 4 * pairs * r["head_dim"] / (r["time_ms"] * 1e-3) / 1e12)
    for (workload, impl), (r, tflops) in sorted(rates.items()):
        if impl != "kpage":
            continue
        items = math.ceil(int(workload.split("_")[1]) / 128) * r["heads"]
        waves = items / sms
        fill = waves / math.ceil(waves)
        cudnn = rates.get((workload, "cudnn_dense"), (None, float("nan")))[1]
        print(
            f"{workload:13s} {r['heads']:3d} heads  items {items:5d}  waves {waves:6.2f}  "
            f"last-wave fill {fill:.3f}  "
            f"kpage {tflops:4.0f} TF/s ({tflops / fill:4.0f} per busy SM)  cudnn {cudnn:4.0f}  "
            f"ratio {tflops / cudnn:.3f} (with a full last wave {tflops / fill / cudnn:.3f})"
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 132)
