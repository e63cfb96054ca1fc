"""The config engine on a made-up schema: it must work for any dataclass of section dataclasses."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

import pytest

from titanlite.config import engine as E
from titanlite.config import parse as P
from titanlite.config import output
from titanlite.config.engine import option
from titanlite.errors import TitanliteError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class Garden:
    """Plants and water."""

    beds: int = option(3, "number of beds", gt=0)
    water: float = option(1.5, "litres per bed", ge=0, le=10)
    organic: bool = option(True, "no pesticides")
    name: str = option("home", "what to call it", nonempty=True)
    plants: list[str] = option(["rose"], "what grows")
    shade: float | None = option(None, "fraction in shade; none = unknown", ge=0, lt=1, special=None)
    soil: str = option("loam", "soil kind", choices=("loam", "clay", "sand"))


@dataclass
class Kitchen:
    """Where food is made."""

    stoves: int = option(-1, "stoves; -1 = as many as fit", ge=1, special=-1)
    oven_temp: float = option(180.0, "degrees", gt=0, lt=300)
    label: str = option("", "free text")


@dataclass
class House:
    garden: Garden = field(default_factory=Garden)
    kitchen: Kitchen = field(default_factory=Kitchen)


def error(call, *args) -> str:
    with pytest.raises(TitanliteError) as info:
        call(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def meta(section: str, key: str):
    return E.keys(E.sections(House)[section])[key][1].metadata


# --- introspection ---------------------------------------------------------------------


def test_sections_and_keys_in_declaration_order():
    assert list(E.sections(House)) == ["garden", "kitchen"]
    assert E.sections(House)["garden"] is Garden
    assert list(E.keys(Garden)) == ["beds", "water", "organic", "name", "plants", "shade", "soil"]
    assert E.keys(Garden)["shade"][0] == float | None


def test_option_keeps_help_and_rules_and_copies_list_defaults():
    assert meta("garden", "soil")["choices"] == ("loam", "clay", "sand")
    assert meta("kitchen", "stoves")["special"] == -1 and "special" not in meta("garden", "beds")
    a, b = House(), House()
    a.garden.plants.append("tulip")
    assert b.garden.plants == ["rose"]


@pytest.mark.parametrize(
    "tp, words",
    [
        (bool, "a boolean (true/false)"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list[str], "a list of strings"),
        (float | None, "a number or none"),
    ],
)
def test_expected_in_words(tp, words):
    assert E.expected(tp) == words


# --- TOML values -----------------------------------------------------------------------


def test_toml_values_are_coerced_by_field_type():
    cfg = House()
    P.apply_toml(
        cfg,
        tomllib.loads(
            '[garden]\nwater = 2\nshade = "none"\nplants = ["a", "b"]\norganic = false\n'
            "[kitchen]\noven_temp = 200\nstoves = 2\n"
        ),
        "x.toml",
    )
    assert cfg.garden.water == 2.0 and type(cfg.garden.water) is float
    assert cfg.kitchen.oven_temp == 200.0 and type(cfg.kitchen.oven_temp) is float
    assert cfg.garden.shade is None and cfg.garden.plants == ["a", "b"] and cfg.garden.organic is False
    assert cfg.kitchen.stoves == 2 and type(cfg.kitchen.stoves) is int


@pytest.mark.parametrize(
    "text, message",
    [
        ('[garden]\nbeds = "3"\n', "garden.beds: expected an integer, got '3' in x.toml"),
        ("[garden]\nbeds = 3.0\n", "garden.beds: expected an integer, got 3.0 in x.toml"),
        ("[garden]\nbeds = true\n", "garden.beds: expected an integer, got True in x.toml"),
        ('[garden]\norganic = "yes"\n', "garden.organic: expected a boolean (true/false), got 'yes' in x.toml"),
        ("[garden]\nplants = [1]\n", "garden.plants: expected a list of strings, got [1] in x.toml"),
        ('[garden]\nshade = "half"\n', "garden.shade: expected a number or none, got 'half' in x.toml"),
    ],
)
def test_toml_values_of_the_wrong_type(text, message):
    assert error(P.apply_toml, House(), tomllib.loads(text), "x.toml") == message


def test_read_toml_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[garden]\nbeds = = 1\n")
    assert error(P.read_toml, bad, "bad.toml").startswith("invalid TOML in bad.toml: ")
    bad.write_bytes(b'[garden]\nname = "\xff"\n')
    assert error(P.read_toml, bad, "bad.toml").startswith("invalid TOML in bad.toml")
    assert error(P.read_toml, tmp_path, "dir").startswith("cannot read config file dir: ")
    bad.write_text("# only a comment\n")
    assert (
        error(P.read_toml, bad, "bad.toml")
        == "config file bad.toml is empty (it sets no [section] key); leave out --config for the defaults"
    )


def test_a_key_given_twice_on_the_command_line_is_refused():
    P.refuse_repeats([("garden", "beds", 1), ("garden", "name", "x")])
    assert (
        error(P.refuse_repeats, [("garden", "beds", 1), ("garden", "beds", 2)]) == "--garden.beds given twice (1 and 2)"
    )


# --- the command line ------------------------------------------------------------------


def test_cli_pairs_take_the_next_word_unless_it_is_an_option():
    argv = ["--a", "1", "--b=2", "--c", "--d", "-5", "--e=", "--f"]
    assert list(P.cli_pairs(argv, "--x y")) == [
        ("a", "1"),
        ("b", "2"),
        ("c", None),
        ("d", "-5"),
        ("e", ""),
        ("f", None),
    ]


@pytest.mark.parametrize("argv", [["stray"], ["--a", "1", "2"], ["-a"], ["--"]])
def test_cli_pairs_refuse_stray_words_naming_the_usage(argv):
    message = error(lambda: list(P.cli_pairs(argv, "--section.key value")))
    assert message.startswith("unexpected argument ") and message.endswith("; options are --section.key value")


@pytest.mark.parametrize(
    "name, value, parsed",
    [
        ("garden.beds", "4", 4),
        ("garden.water", "0.5", 0.5),
        ("garden.water", "2", 2.0),
        ("garden.name", "", ""),
        ("garden.organic", "no", False),
        ("garden.organic", "YES", True),
        ("garden.organic", "0", False),
        ("garden.organic", None, True),
        ("garden.shade", "None", None),
        ("garden.shade", "0.25", 0.25),
        ("garden.plants", "a, b,", ["a", "b"]),
        ("garden.plants", '["a", "b"]', ["a", "b"]),
        ("garden.plants", "", []),
        ("kitchen.stoves", "-1", -1),
    ],
)
def test_parse_override_by_field_type(name, value, parsed):
    section, key, got = P.parse_override(House, name, value)
    assert (f"{section}.{key}", got, type(got)) == (name, parsed, type(parsed))


@pytest.mark.parametrize(
    "text, names",
    [("float8", ["float8"]), ("float8, mx", ["float8", "mx"]), ('["float8"]', ["float8"]), ("", []), ("[]", [])],
)
def test_parse_list_never_splits_a_name_into_characters(text, names):
    """What a translation (`Translate`) hands on for another tool's list option is this text."""
    assert P.parse_list(text) == names


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("garden.beds", "1.5", "garden.beds: expected an integer, got '1.5'"),
        ("garden.water", "wet", "garden.water: expected a number, got 'wet'"),
        ("garden.organic", "maybe", "garden.organic: expected a boolean (true/false), got 'maybe'"),
        ("garden.plants", "[1]", "garden.plants: expected a list of strings, got '[1]'"),
        ("garden.plants", "[oops", "garden.plants: expected a list of strings, got '[oops'"),
        ("garden.beds", None, "garden.beds: --garden.beds needs a value (an integer)"),
    ],
)
def test_parse_override_errors(name, value, message):
    assert error(P.parse_override, House, name, value) == message


def test_a_long_value_is_quoted_short():
    """A pasted paragraph or a 10,000-digit number: the line quotes its start and says its size."""
    assert error(P.parse_override, House, "garden.beds", "9" * 10_000) == (
        f"garden.beds: expected an integer, got '{'9' * 56}... (10,002 characters)"
    )
    cfg = House()
    cfg.garden.soil = "silt " * 100
    assert error(E.check_values, cfg) == (
        f"garden.soil: must be one of loam, clay, sand (got '{'silt ' * 11}s... (502 characters))"
    )


# --- unknown names ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, message",
    [
        ("garden.bedz", "unknown key garden.bedz on the command line; did you mean garden.beds?"),
        ("kitchen.beds", "unknown key kitchen.beds on the command line; did you mean garden.beds?"),
        ("beds", "unknown key beds on the command line; did you mean garden.beds?"),
        ("gardn.water", "unknown key gardn.water on the command line; did you mean garden.water?"),
        ("gardn.watr", "unknown key gardn.watr on the command line; did you mean garden.water?"),
        ("garden.qqqqqq", "unknown key garden.qqqqqq on the command line"),
    ],
)
def test_unknown_keys_suggest_the_closest(name, message):
    assert error(P.parse_override, House, name, "1") == message


def test_unknown_names_in_toml():
    assert (
        error(P.apply_toml, House(), {"gardn": {"beds": 1}}, "x.toml")
        == "unknown section [gardn] in x.toml; did you mean [garden]?"
    )
    assert error(P.apply_toml, House(), {"beds": 1}, "x.toml") == (
        "unknown key beds in x.toml (keys belong in a [section]); did you mean garden.beds?"
    )
    assert error(P.apply_toml, House(), {"kitchen": {"water": 1}}, "x.toml") == (
        "unknown key kitchen.water in x.toml; did you mean garden.water?"
    )


# --- checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, key, text",
    [
        ("garden", "beds", "> 0"),
        ("garden", "water", "in [0, 10]"),
        ("garden", "shade", "none or in [0, 1)"),
        ("kitchen", "stoves", "-1 or >= 1"),
        ("kitchen", "oven_temp", "in (0, 300)"),
        ("garden", "name", ""),
    ],
)
def test_range_text(section, key, text):
    assert E.range_text(meta(section, key)) == text


def test_range_text_one_sided_upper():
    rules = {"gt": None, "ge": None, "lt": 5, "le": None}
    assert E.range_text(rules) == "< 5" and E.range_text({**rules, "lt": None, "le": 2.5}) == "<= 2.5"


def test_defaults_pass_the_checks():
    E.check_values(House())


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("garden", "beds", 0, "garden.beds: must be > 0 (got 0)"),
        ("garden", "water", 10.5, "garden.water: must be in [0, 10] (got 10.5)"),
        ("garden", "water", float("nan"), "garden.water: must be a finite number (got nan)"),
        ("garden", "shade", 1.0, "garden.shade: must be none or in [0, 1) (got 1.0)"),
        ("garden", "soil", "peat", "garden.soil: must be one of loam, clay, sand (got 'peat')"),
        ("garden", "name", "", "garden.name: must not be empty (got '')"),
        ("garden", "beds", "3", "garden.beds: expected an integer (got '3')"),
        ("garden", "organic", 1, "garden.organic: expected a boolean (true/false) (got 1)"),
        ("kitchen", "stoves", 0, "kitchen.stoves: must be -1 or >= 1 (got 0)"),
        ("kitchen", "stoves", -2, "kitchen.stoves: must be -1 or >= 1 (got -2)"),
    ],
)
def test_check_values_names_the_key_and_value(section, key, value, message):
    cfg = House()
    setattr(getattr(cfg, section), key, value)
    assert error(E.check_values, cfg) == message


def test_check_values_accepts_the_special_value_and_ints_for_floats():
    cfg = House()
    cfg.garden.shade, cfg.kitchen.stoves, cfg.garden.water = None, -1, 10
    E.check_values(cfg)


def test_check_values_wants_section_objects():
    cfg = House()
    cfg.kitchen = {"stoves": 1}
    assert error(E.check_values, cfg) == "kitchen: expected a [kitchen] section (got {'stoves': 1})"


def test_first_problem_in_declaration_order():
    cfg = House()
    cfg.kitchen.stoves, cfg.garden.beds = 0, 0
    assert error(E.check_values, cfg).startswith("garden.beds")


# --- output ----------------------------------------------------------------------------


def test_help_lines():
    lines = output.help_lines(House)
    assert lines[:5] == [
        "",
        "[garden]  Plants and water.",
        "  --garden.beds  int = 3  (> 0)",
        "      number of beds",
        "  --garden.water  float = 1.5  (in [0, 10])",
    ]
    assert '  --garden.plants  list[str] = ["rose"]' in lines
    assert '  --garden.shade  float | none = "none"  (none or in [0, 1))' in lines
    assert '  --garden.soil  loam|clay|sand = "loam"' in lines
    assert "  --kitchen.stoves  int = -1  (-1 or >= 1)" in lines
    assert lines.count("") == 2 and len(lines) == 2 * 2 + 2 * (7 + 3)


def test_to_dict_is_plain_and_to_toml_round_trips(tmp_path):
    cfg = House()
    cfg.garden.name, cfg.garden.plants, cfg.garden.shade = 'quote " back \\ ünï', ["a", "b c"], 0.125
    cfg.kitchen.oven_temp, cfg.kitchen.label = 1e-12, ""
    data = output.to_dict(cfg)
    assert data["garden"]["plants"] == ["a", "b c"] and all(type(v) is dict for v in data.values())
    again = House()
    P.apply_toml(again, tomllib.loads(output.to_toml(cfg)), "round.toml")
    assert again == cfg
    none_again = House()
    P.apply_toml(none_again, tomllib.loads(output.to_toml(House())), "defaults.toml")
    assert none_again == House() and none_again.garden.shade is None


def test_engine_names_no_section_of_ours():
    from pathlib import Path

    source = Path(E.__file__).read_text() + Path(P.__file__).read_text()
    for name in ("training", "optimizer", "checkpoint", "parallelism", "train_configs", "JobConfig"):
        assert name not in source, name
    assert dataclasses.is_dataclass(House)
