"""The Lua library every ledger script starts with (``remote_ledger``): argument parsing,
checked reads of ``info``/``u``/``clock`` that drop what this code did not write, index
upkeep, sweeps, evictions and ancestor lifting — the functions ``RESERVE``, ``COMMIT``,
``RELEASE``, ``REMOVE``, ``ERASE``, ``TOUCH`` and ``USAGE`` share. Kept apart so the scripts and the
Python side of the ledger read on their own; the contract (keys, score, what garbage does)
is in ``remote_ledger``'s docstring."""

from __future__ import annotations

from kvstrata.tiers.remote_tombstones import TOMB_LUA

LEDGER_LUA = (
    TOMB_LUA
    + r"""
local P = ARGV[1]
local INFO, Z, E, PEND, U, CLOCK = P..'info', P..'z', P..'e', P..'p', P..'u', P..'clock'
local touched = {}
local victims = {}
local NOW = 0  -- the caller's clock, once a script has parsed it (a version floor, below)
local recounted = false  -- U was rebuilt in this call (and stays consistent until it ends)

-- ---- reading what may be garbage: a finite number, or nil (never a script error) -------
local function num(raw)
  if type(raw) ~= 'string' and type(raw) ~= 'number' then return nil end
  local x = tonumber(raw)
  if finite(x) then return x end
  return nil
end

local function int(raw)  -- an integer a double holds exactly
  local x = num(raw)
  if x and x == math.floor(x) and math.abs(x) <= 2^53 then return x end
  return nil
end

local function hex(k)
  return type(k) == 'string' and #k > 0 and #k % 2 == 0 and string.match(k, '^%x+$') ~= nil
end

-- A ledger entry, or nil when it is not one this code wrote (bad JSON, a missing or mistyped
-- field, a non-hex key): such an entry is dropped, never trusted (see `get`). `o` (the owner
-- token of its reservation) and `g` (its commit's generation) are absent in older entries.
local function decode(k, raw)
  if not hex(k) then return nil end
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' then return nil end
  if not (int(rec.s) and rec.s >= 0 and type(rec.t) == 'string'
          and (rec.st == 'P' or rec.st == 'C') and finite(rec.u) and finite(rec.x)
          and type(rec.p) == 'string' and finite(rec.v)
          and (rec.o == nil or hex(rec.o)) and (rec.g == nil or int(rec.g))) then
    return nil
  end
  return rec
end

local function victim(k, tenant, reason)
  victims[#victims + 1] = k
  victims[#victims + 1] = tenant
  victims[#victims + 1] = reason
end

-- Remove a corrupt entry from every index (its size is unknown: `recount` fixes the usage);
-- it is reported as a victim ('corrupt') so its writer-side keys are deleted like an eviction.
local function discard(k, raw)
  redis.call('ZREM', Z, k)
  redis.call('ZREM', E, k)
  redis.call('ZREM', PEND, k)
  local tenant = ''
  local ok, rec = pcall(cjson.decode, raw)
  if ok and type(rec) == 'table' and type(rec.t) == 'string' then
    tenant = rec.t
    redis.call('ZREM', P..'t:'..tenant, k)
  end
  redis.call('HDEL', INFO, k)  -- last: a failure above leaves the entry for REPAIR to find
  victim(k, tenant, 'corrupt')
end

-- ---- wrong-typed indexes: checked before a script's first write ----------------------------
-- Redis keeps the writes a script made before it failed, so an index of the wrong type met
-- half-way (another program wrote a string or a list there) would leave a half-done change.
-- Every writing script asks first and answers `wrongtype()` (nothing written); the writer
-- then runs REPAIR and calls again (`remote_ledger`).
local function type_of(k)
  local t = redis.call('TYPE', k)
  if type(t) == 'table' then t = t.ok end
  return t
end

local function zset_or_none(k)
  local t = type_of(k)
  return t == 'zset' or t == 'none'
end

local function info_wrong()  -- INFO itself: a REPAIR rebuilds the ledger from the objects
  local t = type_of(INFO)
  return not (t == 'hash' or t == 'none')
end

local function tenant_of(raw)  -- the tenant an entry names, even one `decode` refuses
  local ok, t = pcall(function() return cjson.decode(raw).t end)
  if ok and type(t) == 'string' then return t end
  return nil
end

local function indexes_wrong(tenant)
  if info_wrong() then return true end
  if not (zset_or_none(Z) and zset_or_none(E) and zset_or_none(PEND)) then return true end
  if tenant and not zset_or_none(P..'t:'..tenant) then return true end
  local fields = redis.pcall('HKEYS', U)
  if type(fields) ~= 'table' or fields.err then  -- U unreadable: INFO names the tenants
    fields = {}
    local all = redis.call('HGETALL', INFO)
    for i = 2, #all, 2 do
      local t = tenant_of(all[i])
      if t then fields[#fields + 1] = 't:'..t end
    end
  end
  for _, f in ipairs(fields) do
    if string.sub(f, 1, 2) == 't:' and not zset_or_none(P..f) then return true end
  end
  return false
end

local function wrongtype()  -- the reply shape LedgerReply parses, with nothing in it
  return {'wrongtype', 0, 0, 0, 0, 0}
end

-- U is derived data (the sums over INFO): when it cannot be read (a wrong type, a field that
-- is not an integer) or an entry of unknown size was dropped, rebuild it from INFO, dropping
-- every corrupt entry met on the way. O(entries), so only after corruption.

-- The ledger's version after a change: one more than `current`, and at least the caller's clock
-- in microseconds. So it never goes back, not even when U is lost or unreadable (up to the
-- writers' clock skew): readers order replies by it, and objects' generations (`remote_format`)
-- are versions that a removal's must exceed to delete them. As a string: Lua would print a
-- number this large in exponent form.
local function next_version(current)
  return string.format('%d', math.max((current or 0) + 1, math.floor(NOW * 1e6)))
end

local function recount()
  local ver = nil
  local old = redis.pcall('HGETALL', U)
  if type(old) == 'table' and not old.err then
    for i = 1, #old, 2 do
      if old[i] == 'ver' then
        ver = int(old[i + 1])
      elseif string.sub(old[i], 1, 2) == 't:' then
        touched[string.sub(old[i], 3)] = true
      end
    end
  end
  local used, n, by = 0, 0, {}
  local all = redis.call('HGETALL', INFO)
  for i = 1, #all, 2 do
    local rec = decode(all[i], all[i + 1])
    if rec then
      used, n = used + rec.s, n + 1
      by[rec.t] = (by[rec.t] or 0) + rec.s
    else
      discard(all[i], all[i + 1])
    end
  end
  recounted = true
  redis.call('DEL', U)
  redis.call('HSET', U, 'used', used, 'n', n, 'ver', next_version(ver))
  for t, bytes in pairs(by) do
    redis.call('HSET', U, 't:'..t, bytes)
    touched[t] = true
  end
end

-- Make sure U is a hash whose `fields` are integers HINCRBY takes (or absent) before they are
-- read or incremented: a repair happens here, before the caller's next write, never half-way.
-- A U without a version while INFO holds entries was lost (a failover, an outside DEL): its
-- sums are rebuilt too.
local function ucheck(fields)
  if recounted then return end
  local got = redis.pcall('HMGET', U, 'ver', unpack(fields))
  if type(got) == 'table' and got.err then recount() return end
  if not got[1] and redis.call('HLEN', INFO) > 0 then recount() return end
  for i = 1, #got do
    local v = got[i]
    if v and not (string.match(v, '^-?%d+$') and #v <= 16) then recount() return end
  end
end

local function uget(field)
  return tonumber(redis.call('HGET', U, field) or '0')
end

local function bump()
  ucheck({})
  redis.call('HSET', U, 'ver', next_version(tonumber(redis.call('HGET', U, 'ver'))))
end

-- GDSF's inflation value L. Garbage (a wrong type, not a finite number) is replaced by the
-- lowest score held, its best estimate (L never exceeds a held score by much).
local function clock()
  local raw = redis.pcall('GET', CLOCK)
  if raw == false then return 0 end
  local x = num(raw)
  if x then return x end
  local low = redis.call('ZRANGE', Z, 0, 0, 'WITHSCORES')
  x = num(low[2]) or 0
  redis.call('SET', CLOCK, string.format('%.17g', x))
  return x
end

-- Is an object of key `k` created at `created` covered by the ledger tombstone of `k`? (The
-- object slot's rule, `covers`: one that cannot be read still marks a deletion.)
local function tombstoned(k, created)
  return covers(redis.pcall('GET', P..'x:'..k), created)
end

local function drop(k, rec)
  ucheck({'used', 'n', 'ver', 't:'..rec.t})
  redis.call('ZREM', Z, k)
  redis.call('ZREM', P..'t:'..rec.t, k)
  redis.call('ZREM', E, k)
  redis.call('ZREM', PEND, k)
  redis.call('HDEL', INFO, k)  -- after the indexes: a failure there leaves a whole entry
  redis.call('HINCRBY', U, 'used', -rec.s)
  redis.call('HINCRBY', U, 'n', -1)
  if redis.call('HINCRBY', U, 't:'..rec.t, -rec.s) <= 0 then
    redis.call('HDEL', U, 't:'..rec.t)
  end
  touched[rec.t] = true
  bump()
end

-- The entry of k, or nil. A corrupt entry is dropped here (and the usage recounted), so no
-- caller ever computes with it and one bad value cannot fail every later call.
local function get(k)
  local raw = redis.call('HGET', INFO, k)
  if not raw then return nil end
  local rec = decode(k, raw)
  if not rec then
    discard(k, raw)
    recount()
  end
  return rec
end

-- Lift the committed ancestors of rec (whose score is `score`) that are not above it to just
-- above it, up the chain, so a parent always outscores its children (leaves go first).
local function lift(rec, score)
  local p, seen = rec.p, {}
  while p ~= '' and not seen[p] do  -- `seen`: garbage parent links may form a cycle
    seen[p] = true
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
  local fields = {'ver', 'used', 'n'}
  for t, _ in pairs(touched) do fields[#fields + 1] = 't:'..t end
  ucheck(fields)  -- may add tenants to `touched` (a recount): read them all below
  local out = {status, uget('ver'), uget('used'), uget('n'), 0}
  local count = 0
  for t, _ in pairs(touched) do
    out[#out + 1] = t
    out[#out + 1] = uget('t:'..t)
    count = count + 1
  end
  out[5] = count
  out[#out + 1] = #victims / 3
  for _, v in ipairs(victims) do out[#out + 1] = v end
  for _, v in ipairs(extra or {}) do out[#out + 1] = v end
  return out
end
"""
)
