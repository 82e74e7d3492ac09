"""A lone generation with the compute-thread decode loop on and off (Engine.solo_decode), alternated in one
process on the same model: python tools/bench_solo_decode.py MODEL [ROUNDS]. Experts in memory, 64-token
prompt, 128 greedy tokens; prints each setting's median decode tok/s and their ratio."""
import asyncio, statistics, sys
import clutor
async def main(path, rounds):
    async with clutor.Model.open(path, io="memory", prefix_cache=0) as model:
        ids = list(range(100, 164))
        res = {True: [], False: []}
        for i in range(rounds * 2 + 2):
            solo = bool(i % 2)
            model.engine.solo_decode = solo
            async for o in model.generate(ids, max_tokens=128, temperature=0.0, ignore_eos=True):
                if o.stats: st = o.stats
            if i >= 2:
                res[solo].append(st.decode_tps)
        for solo in (False, True):
            print(f"solo_decode={solo}: decode tok/s median {statistics.median(res[solo]):.1f} (runs {' '.join(f'{x:.0f}' for x in res[solo])})")
        print(f"ratio on/off {statistics.median(res[True]) / statistics.median(res[False]):.3f}")
asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6))
