"""maxkv.settings: every MAXKV_* variable declared once, read nowhere else, documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from maxkv import settings
from maxkv.settings import SETTINGS, Setting, SettingError

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_every_variable_maxkv_names_is_declared_once_and_read_only_there() -> None:
    """Every ``MAXKV_*`` name in the package's code is a declared setting (or a
    constant, not a variable), and only ``settings.py`` touches the environment."""
    package = ROOT / "python" / "maxkv"
    constants = {"MAXKV_ONLY_FORMATS"}  # a tuple of formats, not a variable
    documented_only = {"MAXKV_ARCH"}  # a shell variable in a docstring's example
    seen: set[str] = set()
    for path in package.rglob("*.py"):
        text = path.read_text()
        seen |= set(re.findall(r"MAXKV_[A-Z0-9_]+", text))
        if path.name != "settings.py":
            code = "\n".join(
                line for line in text.splitlines() if not line.lstrip().startswith("#")
            )
            reads = re.findall(r"os\.environ(?:\.get)?\s*[\[(]\s*[\"'](MAXKV_\w+)", code)
            assert not reads, f"{path.relative_to(ROOT)} reads {reads} itself"
            assert "getenv(" not in code, path
    assert seen - constants - documented_only == set(SETTINGS)
    assert len({s.name for s in SETTINGS.values()}) == len(SETTINGS)


def test_the_settings_table_in_the_docs_is_the_module() -> None:
    text = (ROOT / "docs" / "pipelines.md").read_text()
    table = text.split("### Every setting", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `MAXKV_")]
    documented = {}
    for row in rows:
        name, _default, doc = (cell.strip() for cell in row.strip("|").split(" | "))
        documented[name.strip("`")] = doc
    assert list(documented) == list(SETTINGS)
    for name, doc in documented.items():
        assert doc == SETTINGS[name].doc, name


def test_unset_and_empty_take_the_default_and_values_are_parsed() -> None:
    assert settings.CACHE.read({}) == "paged"
    assert settings.CACHE.read({"MAXKV_CACHE": "  "}) == "paged"
    assert settings.CACHE.read({"MAXKV_CACHE": " Contiguous "}) == "contiguous"
    assert settings.HOST_TIER_GB.read({"MAXKV_HOST_TIER_GB": "0.5"}) == 0.5
    assert settings.TIER_INSECURE.read({"MAXKV_TIER_INSECURE": "yes"}) is True
    assert settings.TIER_INSECURE.read({"MAXKV_TIER_INSECURE": "off"}) is False
    assert settings.TIER_OLD_SECRETS.read({"MAXKV_TIER_OLD_SECRETS": "a, b,,"}) == ("a", "b")
    assert settings.BLEND_CHECK_LAYERS.read({"MAXKV_BLEND_CHECK_LAYERS": "1,3"}) == (1, 3)
    assert settings.SPECULATIVE.read({"MAXKV_SPECULATIVE": "off"}) is None
    assert settings.SPECULATIVE.read({"MAXKV_SPECULATIVE": "NGRAM"}) == "ngram"
    # a separator keeps its spaces, and set empty it is refused, not defaulted
    assert settings.BLEND_SEPARATOR.read({"MAXKV_BLEND_SEPARATOR": " <s> "}) == " <s> "
    with pytest.raises(SettingError, match="MAXKV_BLEND_SEPARATOR=''"):
        settings.BLEND_SEPARATOR.read({"MAXKV_BLEND_SEPARATOR": ""})


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        (settings.CACHE, "pages"),
        (settings.PAGE_SIZE, "0"),
        (settings.PAGE_SIZE, "16k"),
        (settings.ATTENTION_SINKS, "-1"),
        (settings.KEEP_WINDOW_PAGES, "yes"),
        (settings.HOST_TIER_GB, "-1"),
        (settings.HOST_TIER_GB, "nan"),
        (settings.DISK_TIER_GB, "lots"),
        (settings.TIER_ENCRYPT, "maybe"),
        (settings.BLEND, "2"),
        (settings.BLEND_RECOMPUTE_RATIO, "x"),
        (settings.BLEND_CHECK_LAYERS, "1,-2"),
        (settings.BLEND_MAX_PER_BATCH, "0"),
        (settings.BLEND_CHUNK_CONTEXT, "header"),
        (settings.SPECULATIVE, "eagle"),
        (settings.SPECULATIVE_ADAPTIVE, "true"),
        (settings.GREEDY_HEAD, "fast"),
    ],
)
def test_a_value_a_setting_cannot_take_is_refused_by_name(
    setting: Setting[object], value: str
) -> None:
    with pytest.raises(SettingError, match=re.escape(f"{setting.name}={value!r}: expected ")):
        setting.read({setting.name: value})
    assert issubclass(SettingError, ValueError)


def test_unknown_variables_are_found() -> None:
    env = {"MAXKV_CACHE": "paged", "MAXKV_CAHCE": "x", "MAXKV_REDIS_URL": "", "PATH": "/bin"}
    assert settings.unknown(env) == ["MAXKV_CAHCE"]
