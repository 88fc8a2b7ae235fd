"""The remote tier's shared ledger: one set of server-side keys every writer agrees through.

Why a ledger: several workers (processes, machines) write into one Redis/Valkey deployment. If
each relied on the server's ``maxmemory`` policy, the server would evict by its own LRU clock,
blind to what a block is worth (seconds of prefill it saves per byte), to tenant quotas and to
prefix closure. Instead every admission, commit, hit and removal goes through the Lua scripts
below, which run atomically on the server, so writers never race on capacity.

Keys (all share the hash tag ``{<ns>}``, so in a cluster they live on one slot and one script
can touch all of them)::

    {ns}:L:info      hash   key hex → cjson {s: size, t: tenant, st: "P"|"C", u: uses,
                                           x: expires_at or -1, p: parent hex or "", v: value,
                                           o: owner token, g: the commit's generation}
    {ns}:L:z         zset   committed keys by score (lowest goes first)
    {ns}:L:t:<ten>   zset   the same, one per tenant (quota evictions pick from here)
    {ns}:L:e         zset   committed keys with a TTL, by expiry time
    {ns}:L:p         zset   PENDING reservations, by the deadline after which they are stale
    {ns}:L:u         hash   "used" (bytes, pending included), "n" (objects), "t:<tenant>" bytes
    {ns}:L:clock     string GDSF's inflation value L (the score of the last value eviction)
    {ns}:L:x:<hex>   string a deletion's tombstone: deleted_at (server TTL: the tombstone's);
                            RESERVE refuses objects of that key created at or before it

Score (GreedyDual-Size-Frequency; Cao & Irani 1997, Cherkasova 1998)::

    score(x) = L + uses(x) · value(x)        value(x) = saved prefill seconds / byte

``value`` is computed by the writer with the store's own formula (``value_per_byte`` in
``kvstrata.store.value_policy``, the same one the local ``ValuePolicy`` prices objects with)
and passed in. Evicting ``x`` raises ``L`` to ``score(x)``, so objects not used for a while
fall behind newly admitted or recently hit ones: recency, frequency and value per byte in one
static priority, which a sorted set can hold. (The local tiers' LHD-style hit density varies
with the time since last use, which a shared sorted set cannot keep current without rescoring
every member.) Whenever an object's score rises (its commit, a hit), its ancestors that are
not above it are lifted to just above it, all the way up the chain: a parent always scores
above each of its committed children, so leaves go first and eviction never orphans a prefix.
(Lifting only the direct parent on commit is not enough: a later hit on the child, or a
grandchild's commit, leaves the root below its descendants, and on the Mooncake trace ~89% of
such evictions then dropped an object whose children were still resident.) A hit batch is
booked deepest key first, so one walk up a chain lifts it and the shallower keys stop at once.

Time is passed in by the caller (``now``), never read on the server: tests run on fake clocks
and every writer's clock decides for its own requests.

Admission (``RESERVE``, in ``remote_ledger_admit``): stale reservations (a writer died between
reserve and commit) and expired objects are swept first; a tenant whose quota would be exceeded
evicts its own lowest-scoring objects; a full tier evicts the lowest-scoring objects of any
tenant — only when those evictions free enough room (a plan is made before anything is
dropped: PENDING bytes cannot be evicted), never the new key's own ancestors. Quotas are
caps, so when the quotas do not oversubscribe the capacity, no tenant within its quota ever
loses an object to another tenant. Victims are returned to the writer, which deletes their
payload keys (they live on other slots in a cluster); until it does, a reader may still get a
victim's verified bytes, which is harmless.

Ownership: each reservation holds its writer's random owner token (``o``). ``COMMIT`` and
``RELEASE`` (a failed or cancelled store) act only on an entry of the caller's token, so a
writer that stalled past ``pending_timeout_s`` — its reservation swept, the key reserved and
stored by another writer — can neither commit nor drop the other writer's entry. A call sent
again after it ran (``RESERVE``, ``COMMIT`` of the same token) answers ``ok`` and changes
nothing. ``COMMIT`` records the commit's generation (``g``): the version the object's bytes are
written with, which a reader's ``REMOVE`` of corrupt bytes checks, so it never drops a later
store's entry. Readers read an object's entry beside its bytes and serve only committed ones
(``remote_read``): bytes no entry accounts for are never served.

Garbage on the server (another program, a bug, a bad restore) never fails a script: Redis does
not undo a failed script's writes, and an error on every call would open the writers' breakers
on a healthy server. So every value a script reads is checked before it is used, and each
script does its reads, checks and encoding before its first write (its arguments too:
``RESERVE``/``ERASE`` answer ``invalid`` to a number that is not finite, before any write):

- an ``info`` entry that is not one this code wrote (bad JSON, a missing or mistyped field, a
  key that is no hex) is dropped from every index wherever it is met and reported as a victim
  with reason ``corrupt``, so its writer-side keys are deleted like an eviction's;
- ``u`` is derived (the sums over ``info``): when it is unreadable, or an entry of unknown size
  was dropped, it is rebuilt from ``info`` (O(entries), only after corruption);
- a ``clock`` that is no finite number is replaced by the lowest score held;
- a tombstone that is no finite number still marks a deletion: it covers every object of its
  key until it expires or a deletion replaces it (never resurrect deleted data).

An index of the wrong type (``z``, ``e``, ``p`` or a tenant set: another program wrote a string
or a list there) is checked for before a script's first write (``indexes_wrong``: Redis keeps
a failed script's earlier writes, so meeting it half-way would leave a half-done change); the
script then answers ``wrongtype`` with nothing written (one it still meets half-way, a tenant
set no usage figure names, fails with ``WRONGTYPE``), and the writer runs ``REPAIR`` once and
retries the call. ``REPAIR`` deletes every wrong-typed index (tenant sets found by the entries
and by a ``SCAN`` of the ledger's slot), recounts ``u`` and rebuilds each index from what is
still right: ``z`` from the tenant sets and a tenant set from ``z`` (the same members and
scores, so prefix closure holds as it did), ``e`` from the entries' expiry. What nothing else
holds is dropped and reported as a ``corrupt`` victim: a committed entry whose score was in
the lost index only (``z`` and its tenant set both wrong), and every PENDING reservation when
``p`` was lost (its deadline is kept nowhere else; its writer's commit then finds no entry,
a refused store). ``info`` itself of the wrong type holds the only copy of the entries'
sizes, tenants and parents: ``REPAIR`` then clears every index (``rebuilt``) and the writer
that ran it accounts for the objects on the server again from their metas, in order of
depth, through ``RESERVE`` and ``COMMIT`` as any store (``RemoteState._adopt``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvstrata.tiers.remote_ledger_lua import LEDGER_LUA

# ARGV: prefix, key, now, owner token.  status "ok" | "gone" (the reservation went stale, was
# deleted or taken over by another writer's, or its entry was corrupt and dropped) | "invalid".
# extra: the commit's generation (the ledger version the object's bytes are written with,
# ``remote_format``). Sent again after it ran (the same owner, already committed): "ok" with
# the same generation, nothing changed.
COMMIT = (
    LEDGER_LUA
    + r"""
local key, now, owner = ARGV[2], num(ARGV[3]) or 0, ARGV[4]
NOW = now
if not (hex(key) and hex(owner)) then return reply('invalid') end
if indexes_wrong(nil) then return wrongtype() end
local rec = get(key)
if not rec or rec.o ~= owner then return reply('gone') end
if rec.st == 'C' then return reply('ok', {rec.g or ''}) end
touched[rec.t] = true
ucheck({'ver'})
-- Above every version at which an earlier entry of this key left (their late deletes spare
-- these bytes), at most the version at which this one will leave (its own delete takes them).
local gen = next_version(tonumber(redis.call('HGET', U, 'ver')))
rec.st = 'C'
rec.c = now
rec.g = gen
local encoded = cjson.encode(rec)
local score = clock() + rec.u * rec.v
redis.call('HSET', INFO, key, encoded)
redis.call('ZREM', PEND, key)
redis.call('ZADD', Z, score, key)
redis.call('ZADD', P..'t:'..rec.t, score, key)
if rec.x >= 0 then redis.call('ZADD', E, rec.x, key) end
lift(rec, score)
bump()
return reply('ok', {gen})
"""
)

# ARGV: prefix, key, now, grace_s.  A committed entry whose object its writer found missing on
# the server (an outside DEL, a server that evicts keys itself, a crash between commit and
# write) is dropped and reported as a victim ('lost'), so the key can be stored again — once it
# was committed at least grace_s ago (a writer between its commit and its write is not lost;
# an entry without a commit time is old). extra: 1 dropped / 0 kept.
FORGET_LOST = (
    LEDGER_LUA
    + r"""
local key, now, grace = ARGV[2], num(ARGV[3]), num(ARGV[4])
NOW = now or 0
if not (hex(key) and now and grace) then return reply('invalid') end
if indexes_wrong(nil) then return wrongtype() end
local rec = get(key)
if not rec or rec.st ~= 'C' or (finite(rec.c) and now - rec.c < grace) then
  return reply('ok', {0})
end
drop(key, rec)
victim(key, rec.t, 'lost')
return reply('ok', {1})
"""
)

# ARGV: prefix, now, upto, key...  Drops each key's entry: any entry when upto is "" (a
# deletion); with upto "C" only a committed one; with a number only a committed one whose
# generation is at most upto (a reader that found the bytes of that generation corrupt: a
# later store's entry, pending or committed, is not its to drop; an entry without a
# generation counts as old). extra: one 1/0 per key (was it dropped).
REMOVE = (
    LEDGER_LUA
    + r"""
NOW = num(ARGV[2]) or 0
local upto = ARGV[3]
local bound = num(upto)
if not (upto == '' or upto == 'C' or bound) then return reply('invalid') end
if indexes_wrong(nil) then return wrongtype() end
local present = {}
for i = 4, #ARGV do
  local rec = get(ARGV[i])
  if rec and (upto == '' or (rec.st == 'C' and not (bound and rec.g and num(rec.g) > bound)))
  then
    drop(ARGV[i], rec)
    present[#present + 1] = 1
  else
    present[#present + 1] = 0
  end
end
return reply('ok', present)
"""
)

# ARGV: prefix, now, key, owner token, state ("P": only a pending reservation; "": either).
# Drops the entry of a store that failed or was cancelled — only when it is still that
# store's (the same owner token): a writer that stalled past ``pending_timeout_s`` must not
# drop the entry of the writer that took the key over. extra: 1 dropped / 0 not.
RELEASE = (
    LEDGER_LUA
    + r"""
local key, owner, state = ARGV[3], ARGV[4], ARGV[5]
NOW = num(ARGV[2]) or 0
if not (hex(key) and hex(owner) and (state == '' or state == 'P')) then
  return reply('invalid')
end
if indexes_wrong(nil) then return wrongtype() end
local rec = get(key)
if not rec or rec.o ~= owner or (state ~= '' and rec.st ~= state) then
  return reply('ok', {0})
end
drop(key, rec)
return reply('ok', {1})
"""
)

# ARGV: prefix, now, then per key: key hex, deleted_at, tombstone ttl ms.  Sets each key's
# ledger tombstone (a later deletion extends it; an unreadable one is replaced) and drops its
# entry, pending or committed. extra: one tenant per key ("" when the ledger had no entry).
# status "invalid" (nothing written) when a deleted_at or ttl is not a finite number.
ERASE = (
    LEDGER_LUA
    + r"""
NOW = num(ARGV[2]) or 0
for i = 3, #ARGV, 3 do
  local ttl = int(ARGV[i + 2])
  if not (num(ARGV[i + 1]) and ttl and ttl > 0) then return reply('invalid') end
end
if indexes_wrong(nil) then return wrongtype() end
local out = {}
for i = 3, #ARGV, 3 do
  local k, deleted = ARGV[i], num(ARGV[i + 1])
  local tk = P..'x:'..k
  local old = deleted_at(redis.pcall('GET', tk))
  if not old or deleted > old then redis.call('SET', tk, ARGV[i + 1], 'PX', ARGV[i + 2]) end
  local rec = get(k)
  if rec then drop(k, rec); out[#out + 1] = rec.t else out[#out + 1] = '' end
end
return reply('ok', out)
"""
)

# ARGV: prefix, now, key... : a hit on each key (uses + 1, score = L + uses · value), booked
# last key first (loads run head first, so that is deepest first: one lift per chain).
TOUCH = (
    LEDGER_LUA
    + r"""
NOW = num(ARGV[2]) or 0
if indexes_wrong(nil) then return wrongtype() end
local L = clock()
for i = #ARGV, 3, -1 do
  local k = ARGV[i]
  local rec = get(k)
  if rec and rec.st == 'C' then
    rec.u = rec.u + 1
    local encoded = cjson.encode(rec)
    redis.call('HSET', INFO, k, encoded)
    local score = L + rec.u * rec.v
    local old = tonumber(redis.call('ZSCORE', Z, k) or '0')
    if score > old then
      redis.call('ZADD', Z, score, k)
      redis.call('ZADD', P..'t:'..rec.t, score, k)
      lift(rec, score)
    end
  end
end
return reply('ok')
"""
)

# ARGV: prefix, now. Status "repaired" (or "ok": nothing was wrong-typed); victims "corrupt";
# "rebuilt": ``info`` was of the wrong type, every index is cleared and the writer accounts
# for the objects on the server again from their metas (``remote_state``: ``_adopt``).
REPAIR = (
    LEDGER_LUA
    + r"""
NOW = num(ARGV[2]) or 0
local function wrong(k) return not zset_or_none(k) end
local function tenant_sets()
  local names, cursor = {}, '0'
  repeat  -- tenant sets no entry names any more too (a tenant whose last entry went)
    local page = redis.call('SCAN', cursor, 'MATCH', P..'t:*', 'COUNT', 1000)
    cursor = page[1]
    for _, name in ipairs(page[2]) do names[#names + 1] = name end
  until cursor == '0'
  return names
end
if info_wrong() then  -- the entries are lost: nothing else knows sizes, tenants or parents
  redis.call('DEL', INFO, Z, E, PEND)
  for _, name in ipairs(tenant_sets()) do redis.call('DEL', name) end
  recount()  -- to zero, the version going on (or from the clock when U is garbage too)
  return reply('rebuilt')
end
local all = redis.call('HGETALL', INFO)
local recs, tbad = {}, {}
local zbad, ebad, pbad = wrong(Z), wrong(E), wrong(PEND)
local any = zbad or ebad or pbad
local function check(t)
  if type(t) == 'string' and tbad[t] == nil then
    tbad[t] = wrong(P..'t:'..t)
    any = any or tbad[t]
  end
end
for i = 1, #all, 2 do
  local rec = decode(all[i], all[i + 1])
  if rec then
    recs[all[i]] = rec
    check(rec.t)
  else  -- a corrupt entry's tenant set is cleaned by `discard`: check it too
    check(tenant_of(all[i + 1]))
  end
end
for _, name in ipairs(tenant_sets()) do check(string.sub(name, #P + 3)) end
if not any then return reply('ok') end
for k, bad in pairs({[Z] = zbad, [E] = ebad, [PEND] = pbad}) do
  if bad then redis.call('DEL', k) end
end
for t, bad in pairs(tbad) do
  if bad then redis.call('DEL', P..'t:'..t) end
end
local lost = {}
for k, rec in pairs(recs) do
  if rec.st == 'C' then
    local score
    if not zbad then
      score = num(redis.call('ZSCORE', Z, k))
    elseif not tbad[rec.t] then
      score = num(redis.call('ZSCORE', P..'t:'..rec.t, k))
    end
    if score then
      if zbad then redis.call('ZADD', Z, score, k) end
      if tbad[rec.t] then redis.call('ZADD', P..'t:'..rec.t, score, k) end
      if ebad and rec.x >= 0 then redis.call('ZADD', E, rec.x, k) end
    else
      lost[#lost + 1] = k
    end
  elseif pbad then
    lost[#lost + 1] = k
  end
end
recount()  -- U from INFO (dropping corrupt entries): a failed script may have left it off
for _, k in ipairs(lost) do
  drop(k, recs[k])
  victim(k, recs[k].t, 'corrupt')
end
return reply('repaired')
"""
)

# ARGV: prefix, now, tenant...: sweep as every admission does; report these tenants' bytes.
USAGE = (
    LEDGER_LUA
    + r"""
NOW = num(ARGV[2]) or 0
if indexes_wrong(nil) then return wrongtype() end
sweep(NOW)
for i = 3, #ARGV do touched[ARGV[i]] = true end
return reply('ok')
"""
)


@dataclass(frozen=True)
class LedgerReply:
    """A script's reply: status, the ledger's version and usage, victims, extra values."""

    status: str
    version: int
    used: int
    count: int
    tenants: dict[str, int]
    victims: list[Victim]
    extra: list[object]

    @classmethod
    def parse(cls, raw: list[object]) -> LedgerReply:
        ntenants = int(raw[4])  # type: ignore[call-overload]
        tenants = {}
        at = 5
        for _ in range(ntenants):
            tenants[_text(raw[at])] = int(raw[at + 1])  # type: ignore[call-overload]
            at += 2
        nvictims = int(raw[at])  # type: ignore[call-overload]
        at += 1
        victims = [
            Victim(_text(raw[at + 3 * i]), _text(raw[at + 3 * i + 1]), _text(raw[at + 3 * i + 2]))
            for i in range(nvictims)
        ]
        at += 3 * nvictims
        return cls(
            status=_text(raw[0]),
            version=int(raw[1]),  # type: ignore[call-overload]
            used=int(raw[2]),  # type: ignore[call-overload]
            count=int(raw[3]),  # type: ignore[call-overload]
            tenants=tenants,
            victims=victims,
            extra=list(raw[at:]),
        )


@dataclass(frozen=True)
class Victim:
    """An object the ledger removed to make room (or because it expired)."""

    key_hex: str
    tenant: str
    reason: str  # "value" | "quota" | "expired"


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class EntryView:
    """One key's ledger entry as a plain ``HGET`` reads it (no script): its state ("C", "P",
    or "" when it is not one this code wrote) and its owner token ("" when it has none)."""

    state: str
    owner: str

    @classmethod
    def parse(cls, raw: object) -> EntryView | None:
        """None when there is no entry."""
        if raw is None:
            return None
        try:
            rec = json.loads(_text(raw))
        except ValueError:
            return cls("", "")
        if not isinstance(rec, dict) or rec.get("st") not in ("C", "P"):
            return cls("", "")
        owner = rec.get("o")
        return cls(str(rec["st"]), owner if isinstance(owner, str) else "")


def commit_generation(reply: LedgerReply) -> int:
    """The generation a ``COMMIT`` reply gives the object's bytes (its ledger version when the
    reply carries none: an entry committed by an older writer)."""
    raw = _text(reply.extra[0]) if reply.extra else ""
    return int(raw) if raw.isdigit() else reply.version
