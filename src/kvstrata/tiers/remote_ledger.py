"""The remote tier's shared ledger: one set of server-side keys every writer agrees through.

Why a ledger: several workers (processes, machines) write into one Redis/Valkey deployment. If
each relied on the server's ``maxmemory`` policy, the server would evict by its own LRU clock,
blind to what a block is worth (seconds of prefill it saves per byte), to tenant quotas and to
prefix closure. Instead every admission, commit, hit and removal goes through the Lua scripts
below, which run atomically on the server, so writers never race on capacity.

Keys (all share the hash tag ``{<ns>}``, so in a cluster they live on one slot and one script
can touch all of them)::

    {ns}:L:info      hash   key hex → cjson {s: size, t: tenant, st: "P"|"C", u: uses,
                                           x: expires_at or -1, p: parent hex or "", v: value}
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

Admission (``reserve``): stale reservations (a writer died between reserve and commit) and
expired objects are swept first; a tenant whose quota would be exceeded evicts its own
lowest-scoring objects; a full tier evicts the lowest-scoring objects of any tenant. Quotas are
caps, so when the quotas do not oversubscribe the capacity, no tenant within its quota ever
loses an object to another tenant. Victims are returned to the writer, which deletes their
payload keys (they live on other slots in a cluster); until it does, a reader may still get a
victim's verified bytes, which is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass

_COMMON = r"""
local P = ARGV[1]
local INFO, Z, E, PEND, U, CLOCK = P..'info', P..'z', P..'e', P..'p', P..'u', P..'clock'
local touched = {}
local victims = {}

local function bump()
  redis.call('HINCRBY', U, 'ver', 1)
end

local function drop(k, rec)
  redis.call('HDEL', INFO, k)
  redis.call('ZREM', Z, k)
  redis.call('ZREM', P..'t:'..rec.t, k)
  redis.call('ZREM', E, k)
  redis.call('ZREM', PEND, k)
  redis.call('HINCRBY', U, 'used', -rec.s)
  redis.call('HINCRBY', U, 'n', -1)
  if redis.call('HINCRBY', U, 't:'..rec.t, -rec.s) <= 0 then
    redis.call('HDEL', U, 't:'..rec.t)
  end
  touched[rec.t] = true
  bump()
end

local function get(k)
  local raw = redis.call('HGET', INFO, k)
  if not raw then return nil end
  return cjson.decode(raw)
end

-- Lift the committed ancestors of rec (whose score is `score`) that are not above it to just
-- above it, up the chain, so a parent always outscores its children (leaves go first).
local function lift(rec, score)
  local p = rec.p
  while p ~= '' do
    local pscore = redis.call('ZSCORE', Z, p)
    if not pscore or tonumber(pscore) > score then return end
    local prec = get(p)
    if not prec then return end
    score = score + math.max(math.abs(score) * 1e-12, 1e-300)
    redis.call('ZADD', Z, score, p)
    redis.call('ZADD', P..'t:'..prec.t, score, p)
    p = prec.p
  end
end

local function victim(k, tenant, reason)
  victims[#victims + 1] = k
  victims[#victims + 1] = tenant
  victims[#victims + 1] = reason
end

-- Sweep stale reservations and expired objects (bounded work per call).
-- Expired committed objects become victims (their payload keys must go too).
local function sweep(now)
  for _, k in ipairs(redis.call('ZRANGEBYSCORE', PEND, '-inf', now, 'LIMIT', 0, 64)) do
    local rec = get(k)
    if rec then drop(k, rec) else redis.call('ZREM', PEND, k) end
  end
  for _, k in ipairs(redis.call('ZRANGEBYSCORE', E, '-inf', now, 'LIMIT', 0, 64)) do
    local rec = get(k)
    if rec then
      drop(k, rec)
      victim(k, rec.t, 'expired')
    else
      redis.call('ZREM', E, k)
    end
  end
end

-- {status, ver, used, n, #tenants, tenant, bytes, ..., #victims, victims..., extra...}
local function reply(status, extra)
  local out = {status, tonumber(redis.call('HGET', U, 'ver') or '0'),
               tonumber(redis.call('HGET', U, 'used') or '0'),
               tonumber(redis.call('HGET', U, 'n') or '0'), 0}
  local count = 0
  for t, _ in pairs(touched) do
    out[#out + 1] = t
    out[#out + 1] = tonumber(redis.call('HGET', U, 't:'..t) or '0')
    count = count + 1
  end
  out[5] = count
  out[#out + 1] = #victims / 3
  for _, v in ipairs(victims) do out[#out + 1] = v end
  for _, v in ipairs(extra or {}) do out[#out + 1] = v end
  return out
end
"""

# ARGV: prefix, key, size, tenant, value, quota (-1: none), capacity, now, pending_deadline,
#       expires_at (-1: none), parent ("" for none), created_at.
# status: "ok" | "exists" | "quota" | "no_room" | "tombstoned"
RESERVE = (
    _COMMON
    + r"""
local key, size, tenant = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local value, quota, capacity = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now, deadline, expires = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local parent, created = ARGV[11], tonumber(ARGV[12])
touched[tenant] = true
sweep(now)
local tomb = redis.call('GET', P..'x:'..key)
if tomb and created <= tonumber(tomb) then return reply('tombstoned') end
if redis.call('HEXISTS', INFO, key) == 1 then return reply('exists') end
if quota >= 0 and size > quota then return reply('quota') end
if size > capacity then return reply('no_room') end
local function evict_lowest(zkey, reason)
  local low = redis.call('ZRANGE', zkey, 0, 0, 'WITHSCORES')
  if #low == 0 then return false end
  local k, score = low[1], tonumber(low[2])
  local rec = get(k)
  if rec then
    drop(k, rec)
    victim(k, rec.t, reason)
  else
    redis.call('ZREM', zkey, k)
  end
  local clock = tonumber(redis.call('GET', CLOCK) or '0')
  if score > clock then redis.call('SET', CLOCK, string.format('%.17g', score)) end
  return true
end
if quota >= 0 then
  while tonumber(redis.call('HGET', U, 't:'..tenant) or '0') + size > quota do
    if not evict_lowest(P..'t:'..tenant, 'quota') then return reply('quota') end
  end
end
while tonumber(redis.call('HGET', U, 'used') or '0') + size > capacity do
  if not evict_lowest(Z, 'value') then return reply('no_room') end
end
local rec = {s = size, t = tenant, st = 'P', u = 1, x = expires, p = parent, v = value}
redis.call('HSET', INFO, key, cjson.encode(rec))
redis.call('ZADD', PEND, deadline, key)
redis.call('HINCRBY', U, 'used', size)
redis.call('HINCRBY', U, 'n', 1)
redis.call('HINCRBY', U, 't:'..tenant, size)
bump()
return reply('ok')
"""
)

# ARGV: prefix, key, now.  status "ok" | "gone" (the reservation went stale or was deleted)
COMMIT = (
    _COMMON
    + r"""
local key, now = ARGV[2], tonumber(ARGV[3])
local rec = get(key)
if not rec or rec.st ~= 'P' then return reply('gone') end
touched[rec.t] = true
rec.st = 'C'
redis.call('HSET', INFO, key, cjson.encode(rec))
redis.call('ZREM', PEND, key)
local clock = tonumber(redis.call('GET', CLOCK) or '0')
local score = clock + rec.u * rec.v
redis.call('ZADD', Z, score, key)
redis.call('ZADD', P..'t:'..rec.t, score, key)
if rec.x >= 0 then redis.call('ZADD', E, rec.x, key) end
lift(rec, score)
bump()
return reply('ok')
"""
)

# ARGV: prefix, now, key...  extra: one 1/0 per key (was it in the ledger)
REMOVE = (
    _COMMON
    + r"""
local present = {}
for i = 3, #ARGV do
  local rec = get(ARGV[i])
  if rec then drop(ARGV[i], rec); present[#present + 1] = 1 else present[#present + 1] = 0 end
end
return reply('ok', present)
"""
)

# ARGV: prefix, now, then per key: key hex, deleted_at, tombstone ttl ms.  Sets each key's
# ledger tombstone (a later deletion extends it) and drops its entry, pending or committed.
# extra: one tenant per key ("" when the ledger had no entry).
ERASE = (
    _COMMON
    + r"""
local out = {}
for i = 3, #ARGV, 3 do
  local k, deleted = ARGV[i], tonumber(ARGV[i + 1])
  local tk = P..'x:'..k
  local old = tonumber(redis.call('GET', tk) or '-1')
  if deleted > old then redis.call('SET', tk, ARGV[i + 1], 'PX', ARGV[i + 2]) end
  local rec = get(k)
  if rec then drop(k, rec); out[#out + 1] = rec.t else out[#out + 1] = '' end
end
return reply('ok', out)
"""
)

# ARGV: prefix, now, key... : a hit on each key (uses + 1, score = L + uses · value), booked
# last key first (loads run head first, so that is deepest first: one lift per chain).
TOUCH = (
    _COMMON
    + r"""
local clock = tonumber(redis.call('GET', CLOCK) or '0')
for i = #ARGV, 3, -1 do
  local k = ARGV[i]
  local rec = get(k)
  if rec and rec.st == 'C' then
    rec.u = rec.u + 1
    redis.call('HSET', INFO, k, cjson.encode(rec))
    local score = clock + rec.u * rec.v
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

# ARGV: prefix, now, tenant...: sweep as every admission does; report these tenants' bytes.
USAGE = (
    _COMMON
    + r"""
sweep(tonumber(ARGV[2]))
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
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
