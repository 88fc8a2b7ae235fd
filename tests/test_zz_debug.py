import itertools, random, threading
from pathlib import Path
import redis
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig
from tier_helpers import CAPACITY, OBJ, FakeClock, load_bytes, make_object

def test_debug(remote_server, remote_namespace):
    for attempt in range(30):
        ns = f"{remote_namespace}-{attempt}"
        tier = RemoteTier(RemoteConfig(url=remote_server.url, namespace=ns), CAPACITY, clock=FakeClock())
        objects = [make_object(i, size=OBJ // (1 + i % 3)) for i in range(12)]
        log = []; seq = itertools.count(); lk = threading.Lock()
        def rec(*a):
            with lk: log.append((next(seq), threading.get_ident() % 1000, *a))
        def worker(seed):
            rng = random.Random(seed + attempt * 10)
            for _ in range(300):
                meta, payload = objects[rng.randrange(len(objects))]
                k = meta.key.hex()[:6]; op = rng.random()
                if op < 0.4:
                    rec("prep>", k); slot = tier.prepare_store(meta); rec("prep<", k, slot is not None)
                    if slot is not None:
                        slot.buffer[:] = payload; ok = rng.random() < 0.9
                        rec("comp>", k, ok); r = tier.complete_store(slot, ok); rec("comp<", k, r)
                elif op < 0.8:
                    rec("load>", k); got = load_bytes(tier, meta.key); rec("load<", k, got is not None)
                else:
                    rec("rm>", k); r = tier.remove(meta.key); rec("rm<", k, r)
        ts = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        visible = {k.hex()[:6] for k in tier.keys()}
        r = redis.Redis.from_url(remote_server.url)
        ledger = {k.decode()[:6] for k in r.hkeys(f"{{{ns}}}:L:info")}
        sizes = {m.key.hex()[:6]: m.size for m, _ in objects}
        if tier.used_bytes != sum(sizes[k] for k in visible):
            print("ATTEMPT", attempt, "used", tier.used_bytes, "visible", sorted(visible), "ledger", sorted(ledger))
            bad = (visible ^ ledger)
            for k in bad:
                print("KEY", k, "in visible" if k in visible else "in ledger")
                for e in log[-2000:]:
                    if e[3] == k: print("   ", e)
            tier.close()
            assert False
        tier.close()
