"""Admission to the shared ledger (``remote_ledger``): ``RESERVE`` and its eviction plan.

A reservation is refused or admitted whole: it never evicts objects and then refuses.

- **Plan first, then evict.** ``used`` counts PENDING reservations, which cannot be evicted
  (their writers are between reserve and commit). So before anything is dropped, the script
  walks the candidates — the tenant's own set for its quota, then ``z`` for the capacity, each
  from the lowest score — and sums the sizes of the committed ones it may evict until they
  would free enough. Only when both plans succeed are the planned victims dropped; otherwise
  the reservation is refused (``quota`` / ``no_room``) with nothing evicted. A plan looks at
  most ``SCAN_LIMIT`` candidates per index (bounded work under the server's one thread; a
  reservation that would need more is refused).
- **Never the new key's own prefix.** A PENDING child is not in ``z``, so its parent — a leaf
  until the child commits — may score lowest of all; evicting it would admit an orphan no
  prefix lookup can reach. The plan skips the new key's ancestors (parent links in ``info``,
  at most ``ANCESTRY_LIMIT`` deep). It walks them lazily: commits and hits lift a chain so a
  committed parent outscores its children, so before a candidate of score ``sc`` the walk
  only goes on past ancestors that are not committed or score at most ``sc`` — usually a
  step or two, where walking the whole chain cost a deep prompt ~1,000 lookups per block.
- **Owned.** Each reservation carries its writer's random owner token (``o``); a reservation
  sent again with the same token (a re-sent call whose first try did run) is answered
  ``ok`` without a second entry. ``COMMIT`` and ``RELEASE`` act only on the caller's token.

A stale member of an index (no entry) or a corrupt entry met by a plan is cleaned as every
script cleans it (a ``corrupt`` victim), never counted as room.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from kvstrata.objects import KVObjectMeta
from kvstrata.tiers.remote_ledger_lua import LEDGER_LUA

SCAN_LIMIT = 4096
"""Candidates one eviction plan looks at before it refuses."""

ANCESTRY_LIMIT = 1024
"""Parent links a plan follows up from the new key to protect its prefix."""


def new_owner() -> str:
    """A reservation's owner token: random, hex (the ledger checks it is hex)."""
    return secrets.token_hex(8)


def reserve_args(
    prefix: str,
    meta: KVObjectMeta,
    *,
    value: float,
    quota: int | None,
    capacity: int,
    now: float,
    pending_timeout_s: float,
    owner: str,
) -> list[Any] | None:
    """``RESERVE``'s ARGV for ``meta``; None when one of its numbers is not finite (e.g.
    ``recompute_s`` = inf: no score to rank it by), which the script would refuse as
    ``invalid``."""
    expires = meta.expires_at()
    deadline = now + pending_timeout_s
    numbers = [value, now, deadline, float(meta.created_at)]
    if expires is not None:
        numbers.append(expires)
    if not all(math.isfinite(x) for x in numbers):
        return None
    return [
        prefix,
        meta.key.hex(),
        meta.size,
        meta.tenant,
        repr(value),
        -1 if quota is None else quota,
        capacity,
        repr(now),
        repr(deadline),
        -1 if expires is None else repr(expires),
        meta.parent.hex() if meta.parent is not None else "",
        repr(float(meta.created_at)),
        owner,
    ]


# ARGV: prefix, key, size, tenant, value, quota (-1: none), capacity, now, pending_deadline,
#       expires_at (-1: none), parent ("" for none), created_at, owner token (hex).
# status: "ok" | "exists" | "quota" | "no_room" | "tombstoned" | "invalid" (an argument is not
# a hex key, a size, a finite number: refused before any write).
# Every read that can meet garbage, and the new entry's encoding, come before the first write;
# the plan reads only; from then on nothing can fail half-way (every drop is whole).
RESERVE = (
    LEDGER_LUA
    + f"local SCAN_LIMIT, ANCESTRY_LIMIT = {SCAN_LIMIT}, {ANCESTRY_LIMIT}\n"
    + r"""
local key, size, tenant = ARGV[2], int(ARGV[3]), ARGV[4]
local value, quota, capacity = num(ARGV[5]), int(ARGV[6]), int(ARGV[7])
local now, deadline, expires = num(ARGV[8]), num(ARGV[9]), num(ARGV[10])
local parent, created, owner = ARGV[11], num(ARGV[12]), ARGV[13]
NOW = now or 0
if not (hex(key) and size and size >= 0 and value and quota and capacity and now and deadline
        and expires and created and (parent == '' or hex(parent)) and hex(owner)) then
  return reply('invalid')
end
if indexes_wrong(tenant) then return wrongtype() end
local rec = {s = size, t = tenant, st = 'P', u = 1, x = expires, p = parent, v = value, o = owner}
local encoded = cjson.encode(rec)
touched[tenant] = true
if tombstoned(key, created) then return reply('tombstoned') end
local L = clock()
sweep(now)
local held = redis.call('HGET', INFO, key)
if held then
  local mine = decode(key, held)
  if mine and mine.o == owner then return reply('ok') end  -- this reservation, sent again
  return reply('exists')
end
if quota >= 0 and size > quota then return reply('quota') end
if size > capacity then return reply('no_room') end
ucheck({'used', 'n', 'ver', 't:'..tenant})

-- The new key's ancestors: never victims (an orphan no lookup reaches). Walked lazily: up to
-- the first committed ancestor scoring above the candidate at hand (its own ancestors score
-- higher still), so candidates met in score order find every ancestor that could be one.
local keep, frontier, depth = {}, parent, 0
local function protected(k, sc)
  while frontier ~= '' and depth < ANCESTRY_LIMIT and not keep[frontier] do
    local fsc = redis.call('ZSCORE', Z, frontier)
    if fsc and tonumber(fsc) > sc then break end
    keep[frontier] = true
    depth = depth + 1
    local raw = redis.call('HGET', INFO, frontier)
    local prec = raw and decode(frontier, raw)
    frontier = prec and prec.p or ''
  end
  return keep[k] or false
end

-- Pick committed entries of `zkey` from its lowest score until they free `need` bytes;
-- reads only. Stale members and corrupt entries are noted in `junk` (cleaned, not room).
local picked, chosen, junk, freed = {}, {}, {}, 0
local function plan(zkey, need, reason)
  if need <= 0 then return true end
  local start = 0
  while start < SCAN_LIMIT do
    local page = redis.call('ZRANGE', zkey, start, start + 127, 'WITHSCORES')
    if #page == 0 then return false end
    for i = 1, #page, 2 do
      local k = page[i]
      if not chosen[k] and not protected(k, tonumber(page[i + 1])) then
        local raw = redis.call('HGET', INFO, k)
        local vrec = raw and decode(k, raw)
        if vrec and vrec.st == 'C' then
          chosen[k] = true
          picked[#picked + 1] = {k, tonumber(page[i + 1]), reason}
          freed = freed + vrec.s
          need = need - vrec.s
          if need <= 0 then return true end
        elseif not vrec then
          junk[#junk + 1] = {k, zkey}
        end
      end
    end
    start = start + 128
  end
  return false
end

local refused = nil
if quota >= 0 and not plan(P..'t:'..tenant, uget('t:'..tenant) + size - quota, 'quota') then
  refused = 'quota'
elseif not plan(Z, uget('used') + size - capacity - freed, 'value') then
  refused = 'no_room'
end
for _, j in ipairs(junk) do  -- a stale member, or a corrupt entry (`get` drops it)
  if not get(j[1]) then redis.call('ZREM', j[2], j[1]) end
end
if refused then return reply(refused) end
for _, v in ipairs(picked) do
  local vrec = get(v[1])
  if vrec then
    drop(v[1], vrec)
    victim(v[1], vrec.t, v[3])
    if v[2] > L then
      L = v[2]
      redis.call('SET', CLOCK, string.format('%.17g', v[2]))
    end
  end
end
if quota >= 0 and uget('t:'..tenant) + size > quota then return reply('quota') end
if uget('used') + size > capacity then return reply('no_room') end  -- a recount moved it
redis.call('HSET', INFO, key, encoded)
redis.call('ZADD', PEND, deadline, key)
redis.call('HINCRBY', U, 'used', size)
redis.call('HINCRBY', U, 'n', 1)
redis.call('HINCRBY', U, 't:'..tenant, size)
bump()
return reply('ok')
"""
)
