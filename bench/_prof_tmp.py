import time, cProfile, pstats, tempfile, sys
import mlx.core as mx
from bench.random_model import make_random_model
from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.runner.loader import load_model
from mlx_lm.generate import generate_step
d = tempfile.mkdtemp()
path = make_random_model(d, "tiny")
loaded = load_model(str(path))
prompt = list(range(1, 129))
N = 1000
def ours():
    core = EngineCore(loaded, EngineConfig(enable_prefix_cache=False))
    core.add_request(Request("a", prompt, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)))
    n = 0
    while core.has_unfinished_requests():
        for o in core.step(): n += len(o.new_token_ids)
    return n
def ref():
    n = 0
    for t, lp in generate_step(mx.array(prompt, mx.uint32), loaded.model, max_tokens=N):
        n += 1
    return n
for f in (ours, ref, ours, ref):
    t = time.perf_counter(); n = f(); dt = time.perf_counter() - t
    print(f.__name__, n, f"{dt*1e6/n:.0f} us/token")
if len(sys.argv) > 1:
    cProfile.run("ours()", "/tmp/prof.out")
    pstats.Stats("/tmp/prof.out").sort_stats("tottime").print_stats(25)
