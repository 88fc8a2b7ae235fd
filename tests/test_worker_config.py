"""The one worker configuration: TOML file, overrides, clear errors, one default everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvstrata.cli import serve_cmd, up_cmd
from kvstrata.cli.config_cmd import describe
from kvstrata.connectors.vllm_settings import connector_config
from kvstrata.errors import ConfigError, InvalidInput
from kvstrata.fleet.supervisor import WorkerSpec
from kvstrata.identity import secret_digest
from kvstrata.runtime.config import ServeLimits, WorkerConfig, load_worker_config
from kvstrata.runtime.config_overrides import OVERRIDES
from kvstrata.runtime.config_reference import reference_markdown
from kvstrata.runtime.config_schema import GIB, KEYS
from kvstrata.runtime.read_layouts import ReadLayout
from kvstrata.store.config import RolloutConfig, WritePolicy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "worker.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return path


def _args(command: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve_cmd.register(sub)
    up_cmd.register(sub)
    return parser.parse_args([command, *argv])


def test_reference_page_is_generated_from_the_schema() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == reference_markdown(), "run: kvstrata config --reference > docs/configuration.md"
    for key in KEYS:
        assert key.path.removeprefix("tiers.") in page
    for name in OVERRIDES:
        assert f"`{name}`" in page


def test_example_file_loads_with_every_tier_setting(tmp_path: Path) -> None:
    config = load_worker_config(EXAMPLE)
    assert [spec.name for spec in config.tiers] == ["host", "disk"]
    host, disk = config.tiers
    assert host.capacity_bytes == 2 * GIB and host.config.write_policy is WritePolicy.WRITE_THROUGH
    assert disk.config.write_policy is WritePolicy.WRITE_BACK and disk.durable
    assert disk.path == Path("~/.cache/kvstrata/disk-tier").expanduser()
    assert config.pool_bytes == GIB and config.block_size == 16


def test_per_tier_settings_quota_ttl_rollout_digest(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    path = _write(
        tmp_path,
        f"""
tenant_secret_file = "{secret.name}"
[[tiers]]
name = "host"
gib = 0.5
ttl_s = 30
verify_reads = false
quota_gib = {{ alice = 0.25 }}
default_quota_gib = 0.125
write_back_max_mib = 64
[tiers.rollout]
tenants = ["alice", "bob"]
canary = 0.5
min_reusable_tokens = 64
[[tiers]]
name = "disk"
path = "d"
gib = 1
write_policy = "selective"
selective_min_uses = 3
ttl_s = 3600
""",
    )
    config = load_worker_config(path)
    host, disk = config.tiers
    assert host.config.ttl_s == 30 and disk.config.ttl_s == 3600  # one TTL per tier
    assert host.config.verify_reads is False and disk.config.verify_reads is True
    assert host.config.tenant_quota_bytes == {"alice": GIB // 4}
    assert host.config.default_tenant_quota_bytes == GIB // 8
    assert host.config.write_back_max_bytes == 64 << 20
    assert host.config.rollout.tenants == frozenset({"alice", "bob"})
    assert host.config.rollout.canary_fraction == 0.5
    assert host.config.rollout.min_reusable_tokens == 64
    assert disk.config.rollout.min_reusable_tokens == 0
    assert disk.config.selective_min_uses == 3
    assert disk.path == tmp_path / "d"  # relative to the file
    assert config.tenant_secret == b"s3cret"
    assert config.secret_digest == secret_digest(b"s3cret") != secret_digest(b"")
    assert "s3cret" not in repr(config) and "s3cret" not in str(describe(config))


def test_read_layouts_from_the_file(tmp_path: Path) -> None:
    assert load_worker_config().read_layouts == ()  # none unless named
    path = _write(
        tmp_path,
        "[pool]\nblock_size = 32\n[[pool.read_layouts]]\nblock_size = 16\n"
        "[[pool.read_layouts]]\norder = 'HTLKD'\ntp_size = 2\ndtype = 'bfloat16'\n",
    )
    config = load_worker_config(path)
    assert config.read_layouts == (
        ReadLayout(block_size=16),
        ReadLayout(order="HTLKD", tp_size=2, dtype="bfloat16"),
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("poool = 1\n", "poool"),
        ("[pool]\ngib = -1\n", "pool.gib"),
        ("[pool]\ngib = 'lots'\n", "pool.gib"),
        ("[[tiers]]\nname = 'host'\ngib = 1\ncolour = 'red'\n", "tiers.colour"),
        ("[[tiers]]\nname = 'tape'\ngib = 1\n", "tiers.name"),
        ("[[tiers]]\nname = 'disk'\ngib = 1\n", "tiers.path"),
        ("[[tiers]]\nname = 'host'\ngib = 1\nwrite_policy = 'sometimes'\n", "tiers.write_policy"),
        (
            "[[tiers]]\nname = 'host'\ngib = 1\n[tiers.rollout]\ncanary = 2\n",
            "tiers.rollout.canary",
        ),
        (
            "[[tiers]]\nname = 'host'\ngib = 1\n[tiers.rollout]\ntenants = []\n",
            "tiers.rollout.tenants",
        ),
        (
            "[[tiers]]\nname = 'host'\ngib = 1\n[tiers.rollout]\nmodels = []\n",
            "tiers.rollout.models",
        ),
        ("[events]\nendpoint = '127.0.0.1:5'\n", "events.endpoint"),
        ("[pool]\nread_layouts = [{block_size = 0}]\n", "pool.read_layouts.block_size"),
        ("[pool]\nread_layouts = [{order = 'LKHT'}]\n", "pool.read_layouts.order"),
        ("[pool]\nread_layouts = [{dtype = 'int8'}]\n", "pool.read_layouts.dtype"),
        ("[pool]\nread_layouts = [{}]\n", "pool.read_layouts.block_size"),
        ("[pool]\nread_layouts = [{colour = 1}]\n", "pool.read_layouts.colour"),
        ("[pool]\nread_layouts = 32\n", "pool.read_layouts"),
        ("tenant_secret_file = 'missing-secret'\n", "tenant_secret_file"),
        ("[limits]\nmax_tokens = 0\n", "limits.max_tokens"),
        ("[limits]\nmax_body_mib = -1\n", "limits.max_body_mib"),
        ("[limits]\nbody_timeout_s = inf\n", "limits.body_timeout_s"),
        ("[limits]\nrequests_per_s = 5\n", "limits.requests_per_s"),
        (
            "[[tiers]]\nname = 'disk'\npath = 'd'\ngib = 1\n[[tiers]]\nname = 'host'\ngib = 1\n",
            "tiers",
        ),
    ],
)
def test_a_bad_file_names_the_key_and_the_file(tmp_path: Path, text: str, key: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        load_worker_config(path)
    assert raised.value.key == key
    assert str(path) in str(raised.value) and repr(key) in str(raised.value)


def test_serve_limits_from_the_file_and_the_flags(tmp_path: Path) -> None:
    assert WorkerConfig().limits == ServeLimits(4096, 4 << 20, 30.0)
    path = _write(tmp_path, "[limits]\nmax_tokens = 512\nmax_body_mib = 0.5\n")
    config = load_worker_config(path)
    assert config.limits == ServeLimits(max_tokens=512, max_body_bytes=1 << 19, body_timeout_s=30.0)
    args = _args("serve", "--config", str(path), "--max-tokens-limit", "64",
                 "--body-timeout-s", "2.5")  # fmt: skip
    assert serve_cmd.worker_config(args).limits == ServeLimits(64, 1 << 19, 2.5)
    assert describe(config)["limits"] == {
        "max_tokens": 512,
        "max_body_bytes": 1 << 19,
        "body_timeout_s": 30.0,
    }


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "[pool\ngib = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_worker_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_worker_config(tmp_path / "absent.toml")


def test_the_cli_reports_a_bad_file_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstrata.cli.main import main

    path = _write(tmp_path, "[pool]\ngib = 0\n")
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pool.gib" in err and str(path) in err and "Traceback" not in err


def test_flags_override_the_file(tmp_path: Path) -> None:
    args = _args(
        "serve",
        "--config", str(EXAMPLE),
        "--host-gib", "0",
        "--disk-dir", str(tmp_path / "elsewhere"),
        "--tier-ttl-s", "5",
        "--pool-gib", "0.5",
    )  # fmt: skip
    config = serve_cmd.worker_config(args)
    assert [spec.name for spec in config.tiers] == ["disk"]  # 0 GiB removed the host tier
    assert config.tiers[0].path == tmp_path / "elsewhere"
    assert config.tiers[0].config.ttl_s == 5
    assert config.tiers[0].config.write_policy is WritePolicy.WRITE_BACK  # from the file
    assert config.pool_bytes == GIB // 2


def test_a_zero_size_removes_its_tier_whatever_the_order_of_the_keys(tmp_path: Path) -> None:
    disk = str(tmp_path / "d")
    for settings in (
        {"host_gib": 0.25, "disk_dir": disk, "disk_gib": 0},
        {"disk_gib": 0, "disk_dir": disk, "host_gib": 0.25},  # re-created it without a size
    ):
        assert [spec.name for spec in connector_config(settings).tiers] == ["host"]


@pytest.mark.parametrize("size", ["abc", [0], True, False])
def test_a_size_that_is_no_number_is_a_config_error(size: object) -> None:
    with pytest.raises(ConfigError) as raised:
        connector_config({"host_gib": size})
    assert raised.value.key == "tiers.gib"


def test_overrides_over_a_file_with_tiers_in_any_order(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[[tiers]]\nname = "host"\ngib = 1\n[tiers.rollout]\ncanary = 0.5\n'
        '[[tiers]]\nname = "disk"\npath = "d"\ngib = 1\n',
    )
    for overrides in (
        {"host_gib": 0, "host_write_policy": "write-back", "policy": "s3fifo"},
        {"policy": "s3fifo", "host_write_policy": "write-back", "host_gib": 0},
    ):
        (disk,) = load_worker_config(path, overrides).tiers  # 0 removed the file's host tier
        assert disk.name == "disk" and disk.eviction_policy == "s3fifo"
    tiers = load_worker_config(path, {"tier_tenants": "a", "remote_gib": 0}).tiers
    assert [t.config.rollout.tenants for t in tiers] == [frozenset({"a"})] * 2
    assert tiers[0].config.rollout.canary_fraction == 0.5  # the file's other rollout key stays


def test_every_override_that_names_tiers_is_marked_for_its_phase() -> None:
    for override in OVERRIDES.values():
        assert override.every_tier == override.help.endswith("of every tier"), override.name
        assert override.size == override.help.endswith("gib (0 removes it)"), override.name


@pytest.mark.parametrize("sizes_first", [True, False])
def test_every_tier_overrides_reach_tiers_named_only_by_their_size(
    tmp_path: Path, sizes_first: bool
) -> None:
    sizes = {"host_gib": 0.25, "disk_dir": str(tmp_path / "d"), "disk_gib": 0.5}
    every = {
        "eviction_policy": "s3fifo",
        "tier_ttl_s": 60,
        "verify_reads": False,
        "tier_tenants": "a,b",
        "tier_canary": 0.5,
        "min_reusable_tokens": 64,
    }
    config = connector_config(sizes | every if sizes_first else every | sizes)
    assert [spec.name for spec in config.tiers] == ["host", "disk"]
    for spec in config.tiers:
        assert spec.eviction_policy == "s3fifo" and spec.config.ttl_s == 60
        assert spec.config.verify_reads is False
        assert spec.config.rollout == RolloutConfig(
            tenants=frozenset({"a", "b"}), canary_fraction=0.5, min_reusable_tokens=64
        )


def test_one_set_of_defaults_for_serve_up_and_the_connector(tmp_path: Path) -> None:
    defaults = WorkerConfig()
    serve = serve_cmd.worker_config(_args("serve"))
    up = up_cmd.worker_config(_args("up"))
    assert serve == defaults and up == defaults
    # A disk tier is written through unless a file or flag says otherwise, for every entry point.
    flags = ("--host-gib", "0.25", "--disk-dir", str(tmp_path / "d"), "--disk-gib", "0.5")
    served = serve_cmd.worker_config(_args("serve", *flags))
    connector = connector_config(
        {"host_gib": 0.25, "disk_dir": str(tmp_path / "d"), "disk_gib": 0.5}
    )
    assert served.tiers == connector.tiers
    assert all(s.config.write_policy is WritePolicy.WRITE_THROUGH for s in connector.tiers)


def test_connector_extra_config_maps_onto_the_same_type(tmp_path: Path) -> None:
    from_file = connector_config({"config": str(EXAMPLE), "stats_path": str(tmp_path / "s")})
    assert from_file.tiers == load_worker_config(EXAMPLE).tiers
    assert from_file.stats_path == tmp_path / "s"
    with pytest.raises(ConfigError, match="needs a tier"):
        connector_config({})
    with pytest.raises(ConfigError, match="'hots_gib'"):
        connector_config({"hots_gib": 1})


def test_up_gives_every_worker_the_file_and_its_own_disk_directory(tmp_path: Path) -> None:
    spec = WorkerSpec("w1", 9001, config=EXAMPLE, pool_gib=None, host_gib=None,
                      disk_dir=tmp_path / "w1")  # fmt: skip
    command = spec.command()
    assert command[command.index("--config") + 1] == str(EXAMPLE)
    assert command[command.index("--disk-dir") + 1] == str(tmp_path / "w1")
    assert "--pool-gib" not in command and "--host-gib" not in command


def test_remote_flags_of_serve_and_up_give_every_worker_the_same_remote_tier() -> None:
    url = "redis://127.0.0.1:6390/0"
    served = serve_cmd.worker_config(_args("serve", "--remote-url", url, "--remote-gib", "2"))
    (remote,) = served.tiers
    assert remote.remote is not None and remote.remote.url == url
    assert remote.capacity_bytes == 2 * GIB
    # up --remote URL: the same tier, its capacity defaulted, passed on to each worker.
    (shared,) = up_cmd.worker_config(_args("up", "--remote", url)).tiers
    assert shared.remote == remote.remote and shared.config == remote.config
    assert shared.capacity_bytes == int(up_cmd.DEFAULT_REMOTE_GIB * GIB)
    command = WorkerSpec("w0", 9000, remote_url=url, remote_gib=up_cmd.DEFAULT_REMOTE_GIB).command()
    assert command[command.index("--remote-url") + 1] == url
    assert float(command[command.index("--remote-gib") + 1]) == up_cmd.DEFAULT_REMOTE_GIB
    with pytest.raises(InvalidInput, match=r"tiers\.url"):
        up_cmd.worker_config(_args("up", "--remote", "localhost:6379"))


def test_serve_rejects_flags_that_break_the_config() -> None:
    with pytest.raises(InvalidInput, match=r"pool\.gib"):
        serve_cmd.worker_config(_args("serve", "--pool-gib", "0"))
    with pytest.raises(InvalidInput, match=r"tiers\.path"):
        serve_cmd.worker_config(_args("serve", "--disk-gib", "1"))


def test_tenant_secret_from_the_environment_unless_a_file_is_set(tmp_path: Path) -> None:

    env = {"KVSTRATA_TENANT_SECRET": "from-env"}
    assert load_worker_config(environ=env).secret_digest == secret_digest(b"from-env")
    assert load_worker_config(environ={}).tenant_secret == b""
    secret = tmp_path / "secret"
    secret.write_bytes(b"from-file")
    config = load_worker_config(overrides={"tenant_secret_file": secret}, environ=env)
    assert config.tenant_secret == b"from-file"


@pytest.mark.parametrize("key", ["tenant_secret_file", "admin_token_file"])
@pytest.mark.parametrize("content", [b"", b"  \n\t\n"])
def test_an_empty_secret_or_token_file_is_refused(tmp_path: Path, key: str, content: bytes) -> None:
    """An empty tenant secret file gave the same salt as no secret (tenant keys derivable
    from tenant names alone), and a blank admin token file silently turned admin off."""
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(0o600)
    config = _write(tmp_path, f'{key} = "{path}"\n')
    with pytest.raises(ConfigError, match="is empty"):
        load_worker_config(config, environ={})
