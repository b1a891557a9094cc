"""Bad config input refused before any work (issue 50 item 8): chained interpolations past the resolution bound,
YAML alias bombs, duplicate keys and ``hydra.callbacks`` in a user's config (nxd_lc.config.interpolation,
nxd_lc.config.preflight, train.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from nxd_lc.config import interpolation, preflight
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.interpolation import interpolation_problems
from nxd_lc.config.preflight import preflight_problems, yaml_error_line, yaml_file_problems
from nxd_lc.config.resolvers import register_resolvers
from nxd_lc.config.structure import to_container

REPO = Path(__file__).resolve().parents[1]
CONF = str(REPO / "conf")
TRAIN = str(REPO / "train.py")


def _chain(n: int, template: str = "${multiply:${k%d},${k%d}}", first: Any = 1) -> dict[str, Any]:
    """k0 = first; k_i references k_(i-1) twice: resolving k_i costs 2^(i+1) - 1 node resolutions."""
    data: dict[str, Any] = {"k0": first}
    for i in range(1, n + 1):
        data[f"k{i}"] = template % (i - 1, i - 1)
    return data


def test_41_chained_multiply_refused_at_once_naming_the_first_key_past_the_bound() -> None:
    with pytest.raises(ConfigError) as e:
        to_container(_chain(40))  # 2^41 resolutions if resolved
    limit = interpolation.MAX_INTERPOLATION_RESOLUTIONS
    first_past = next(i for i in range(41) if 2 ** (i + 1) - 1 > limit)  # independent: the closed form
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith(f"k{first_past}: resolving its interpolations takes more than")


def test_string_doubling_is_counted_like_a_resolver_chain() -> None:
    problems = interpolation_problems(_chain(30, "${k%d}${k%d}", "x"))
    assert len(problems) == 1 and "node resolutions" in problems[0]


@pytest.mark.parametrize("n", [3, 6])
def test_cost_equals_the_closed_form_and_a_chain_within_the_bound_resolves(n: int) -> None:
    total = 1 + sum(2 ** (i + 1) - 1 for i in range(n + 1))  # the root + each key's resolution
    data = _chain(n, first=2)
    assert interpolation_problems(data, limit=total) == []
    assert interpolation_problems(data, limit=total - 1) != []
    register_resolvers()
    assert to_container(data)[f"k{n}"] == 2 ** (2 ** n)  # resolution itself unchanged


def test_relative_and_indexed_references_are_followed() -> None:
    data = {"a": {"x": 1, "y": "${multiply:${.x},${.x}}", "z": "${multiply:${.y},${.y}}"},
            "l": [5, "${l[0]}", "${a.z}${a.z}"]}
    # a: 1 + x 1 + y (1+2) + z (1+2*3) = 12; l: 1 + 1 + (1+1) + (1+2*7) = 19; root 1 -> 32
    assert interpolation_problems(data, limit=32) == []
    assert interpolation_problems(data, limit=31) != []
    cyclic = {"a": "${b}", "b": "${a}"}  # OmegaConf reports the cycle itself; counted once, not refused here
    assert interpolation_problems(cyclic) == []


def test_shipped_configs_stay_far_below_the_bound() -> None:
    for name in sorted(os.listdir(CONF)):
        if name.endswith(".yaml"):
            data = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, name)), resolve=False)
            assert interpolation_problems(data, limit=1000) == [], name


def _alias_bomb(path: Path, levels: int = 8) -> Path:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        prev = "a" if i == 1 else f"l{i - 1}"
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*{prev}"] * 10) + "]")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_alias_bomb_refused_from_the_event_stream_naming_file_and_line(tmp_path: Path) -> None:
    problems = yaml_file_problems(_alias_bomb(tmp_path / "bomb.yaml"))  # 10^9 nodes expanded
    assert len(problems) == 1
    # level i holds 1 + 10 * size(i - 1) nodes, size(a) = 11: level 4 is the first past 20,000
    assert problems[0].startswith(f"{tmp_path / 'bomb.yaml'}: line 5: its anchors and aliases")
    small = _alias_bomb(tmp_path / "small.yaml", levels=2)  # the root: 1 + 3 keys + 11 + 111 + 1111 nodes
    assert yaml_file_problems(small) == []
    assert yaml_file_problems(small, max_nodes=1111) != []


def test_duplicate_key_names_the_dotted_key_and_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("trainer:\n  devices: 1\n  max_steps: 3\n  max_steps: 4\nmodel: {a: 1, a: 2}\n")
    assert yaml_file_problems(path) == [
        f"{path}: key 'trainer.max_steps' is given twice, at line 3 and line 4; keep one",
        f"{path}: key 'model.a' is given twice, at line 5 and line 5; keep one"]


def _user_dir(tmp_path: Path, body: str, name: str = "user") -> Path:
    (tmp_path / f"{name}.yaml").write_text("defaults:\n  - cpu_tiny_llama_config\n  - _self_\n" + body)
    return tmp_path


def _argv(tmp_path: Path, name: str = "user", *extra: str) -> list[str]:
    return ["--config-path", str(tmp_path), "--config-dir", CONF, "--config-name", name, "+dry_run=true", *extra]


def test_preflight_follows_the_defaults_list_and_group_overrides(tmp_path: Path) -> None:
    (tmp_path / "grp").mkdir()
    _alias_bomb(tmp_path / "grp" / "bomb.yaml")
    (tmp_path / "grp" / "ok.yaml").write_text("x: 1\n")
    _user_dir(tmp_path, "", name="inner")
    (tmp_path / "user.yaml").write_text("defaults:\n  - inner\n  - grp: ok\n  - _self_\n")
    assert preflight.defaults_files("user", [str(tmp_path), CONF], []) == [
        str(tmp_path / "user.yaml"), str(tmp_path / "grp" / "ok.yaml"), str(tmp_path / "inner.yaml"),
        os.path.join(CONF, "cpu_tiny_llama_config.yaml")]
    problems = preflight_problems(_argv(tmp_path, "user", "grp=bomb"), TRAIN, CONF)
    assert len(problems) == 1 and problems[0].startswith(str(tmp_path / "grp" / "bomb.yaml"))


def test_hydra_callbacks_refused_before_hydra_calls_them(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    _user_dir(tmp_path, "hydra:\n  callbacks:\n    evil:\n      _target_: shutil.copyfile\n"
                        f"      src: /dev/null\n      dst: {victim}\n")
    problems = preflight_problems(_argv(tmp_path), TRAIN, CONF)
    assert len(problems) == 1 and problems[0].startswith("hydra.callbacks: nxd_lc defines no Hydra callbacks")
    assert "evil -> shutil.copyfile" in problems[0]
    on_command_line = preflight_problems(["--config-name", "cpu_tiny_llama_config",
                                          "+hydra.callbacks.x._target_=os.remove"], TRAIN, CONF)
    assert len(on_command_line) == 1 and "x -> os.remove" in on_command_line[0]
    assert preflight_problems(["--config-name", "cpu_tiny_llama_config", "+dry_run=true"], TRAIN, CONF) == []
    assert victim.read_text() == "keep me\n"


def test_logging_factory_and_foreign_launcher_refused() -> None:
    node = {"job_logging": {"handlers": {"h": {"()": "os.system"}}},
            "launcher": {"_target_": "evil.Launcher"}, "sweeper": {"_target_": preflight.HYDRA_OWN_TARGETS[1]}}
    problems = preflight.hydra_node_problems(node)
    assert [p.split(":")[0] for p in problems] == ["hydra.launcher._target_", "hydra.job_logging"]


def test_a_yaml_error_met_while_composing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _user_dir(tmp_path, "trainer:\n  max_steps: 3\n  max_steps: 4\n")
    monkeypatch.setattr(preflight, "defaults_files", lambda *a: [])  # as if the file was not found by the scan
    problems = preflight_problems(_argv(tmp_path), TRAIN, CONF)
    assert problems == [f"{tmp_path / 'user.yaml'}: line 6: found duplicate key max_steps (while constructing a "
                        "mapping at line 5); fix the YAML"]
    assert yaml_error_line(ValueError("no yaml here")) is None


def test_train_py_exits_2_with_one_error_and_nothing_touched(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    _user_dir(tmp_path, "trainer:\n  max_steps: 3\n  max_steps: 4\nhydra:\n  callbacks:\n    evil:\n"
                        f"      _target_: shutil.copyfile\n      src: /dev/null\n      dst: {victim}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, TRAIN, *_argv(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: refused before Hydra composes the config:",
        f"  - {tmp_path / 'user.yaml'}: key 'trainer.max_steps' is given twice, at line 5 and line 6; keep one"]
    assert victim.read_text() == "keep me\n"
