"""neuronmp.host.envconfig: one parser for numeric environment variables."""
from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronmp.errors import ConfigError, VisibilityError
from neuronmp.host import envconfig

NAME = "NEURONMP_TEST_VALUE"


def refused(fn, value, *args, **kwargs) -> str:
    """The message of the ConfigError ``fn`` raises for ``value`` set in the environment."""
    with pytest.raises(ConfigError) as info:
        fn(NAME, *args, environ={NAME: value}, **kwargs)
    err = info.value
    assert err.variable == NAME and isinstance(err, ValueError)
    msg = str(err)
    assert msg.startswith(f"Invalid {NAME}=") and "Accepted:" in msg
    return msg


@pytest.mark.parametrize("value,expected", [("0", 0), ("7", 7), (" 12\t", 12), ("0042", 42),
                                            ("4096", 4096)])
def test_integer_accepted(value, expected):
    assert envconfig.integer(NAME, 5, 0, 4096, environ={NAME: value}) == expected


@pytest.mark.parametrize("value", [None, "", "   "])
def test_unset_or_blank_gives_the_default(value):
    env = {} if value is None else {NAME: value}
    assert envconfig.integer(NAME, 5, 0, 9, environ=env) == 5
    assert envconfig.seconds(NAME, 2.5, environ=env) == 2.5
    assert envconfig.microseconds(NAME, 50.0, environ=env) == 50.0
    assert envconfig.size(NAME, 8 << 20, 4096, 1 << 30, environ=env) == 8 << 20


@pytest.mark.parametrize("value,why", [
    ("\u00b2", "other than ASCII digits"),           # superscript two: str.isdigit() is True
    ("\u0663", "other than ASCII digits"),           # Arabic-Indic three: int() reads it
    ("1_000", "not a whole number"),                 # int() reads it
    ("-1", "not a whole number"), ("+1", "not a whole number"), ("1.0", "not a whole number"),
    ("x", "not a whole number"), ("0x10", "not a whole number"),
    ("4097", "must be <= 4096"),
    ("9" * 5000, "5000 characters long"),            # int() refuses past 4300 digits
])
def test_integer_refused_naming_variable_value_and_accepted(value, why):
    msg = refused(envconfig.integer, value, 5, 0, 4096)
    assert why in msg and "a whole number from 0 to 4096" in msg
    assert len(msg) < 400  # a 5000-digit value is quoted by its start only


def test_integer_below_the_low_bound():
    assert "must be >= 1" in refused(envconfig.integer, "0", 5, 1, 9)


@pytest.mark.parametrize("value,expected", [("0", 0.0), ("2.5", 2.5), (".5", 0.5), ("5.", 5.0),
                                            (" 30 ", 30.0), ("10000000", 1e7)])
def test_seconds_accepted(value, expected):
    assert envconfig.seconds(NAME, 1.0, environ={NAME: value}) == expected


@pytest.mark.parametrize("value,why", [
    ("abc", "not a number"), ("-1", "must be >= 0"), ("-0.5", "must be >= 0"),
    ("nan", "finite"), ("inf", "finite"), ("-Infinity", "finite"), ("1e3", "not a number"),
    ("1,5", "not a number"), ("\u0663", "ASCII"), ("10000001", "must be <= 10000000"),
    ("1" * 40, "40 characters long"),
])
def test_seconds_refused(value, why):
    msg = refused(envconfig.seconds, value, 1.0)
    assert why in msg and "seconds from 0 to 10000000" in msg


def test_seconds_own_bounds_and_accepted_text():
    msg = refused(envconfig.seconds, "0.5", 1.0, 1.0, 60.0, accepted="1 to 60 seconds")
    assert "must be >= 1" in msg and msg.endswith("Accepted: 1 to 60 seconds")


def test_microseconds():
    assert envconfig.microseconds(NAME, 50.0, environ={NAME: "2000"}) == 2000.0
    assert envconfig.microseconds(NAME, 50.0, environ={NAME: "0.5"}) == 0.5
    msg = refused(envconfig.microseconds, "-3", 50.0)
    assert "must be >= 0" in msg and "microseconds from 0 to 1000000" in msg
    assert "must be <= 1000000" in refused(envconfig.microseconds, "1000001", 50.0)


@pytest.mark.parametrize("value,expected", [
    ("8388608", 8 << 20), ("8MiB", 8 << 20), ("8 MiB", 8 << 20), ("64KiB", 64 << 10),
    ("1GiB", 1 << 30), ("4096", 4096),
])
def test_size_accepted(value, expected):
    assert envconfig.size(NAME, 1, 4096, 1 << 30, environ={NAME: value}) == expected


@pytest.mark.parametrize("value,why", [
    ("huge", "not a byte count"), ("1e6", "not a byte count"), ("8MB", "not a byte count"),
    ("8M", "not a byte count"), ("8mib", "not a byte count"), ("-1", "not a byte count"),
    ("2GiB", "must be <= 1073741824"), ("100", "must be >= 4096"),
    ("\u00b2MiB", "ASCII"),
])
def test_size_refused(value, why):
    msg = refused(envconfig.size, value, 1, 4096, 1 << 30)
    assert why in msg and "from 4KiB to 1GiB" in msg and "8MiB" in msg


def test_string_parsers_raise_the_callers_error_class():
    with pytest.raises(VisibilityError) as info:
        envconfig.parse_integer("NEURON_RT_NUM_CORES", "\u00b2", 0, 16, accepted="0 to 16",
                                error=VisibilityError)
    assert info.value.value == "\u00b2" and info.value.accepted == "0 to 16"
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is VisibilityError and str(back) == str(info.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=50))
def test_any_text_gives_a_number_in_bounds_or_a_config_error(text):
    for fn, args in ((envconfig.integer, (0, 3, 100)), (envconfig.seconds, (1.0, 0.0, 100.0)),
                     (envconfig.size, (1, 0, 1 << 20))):
        try:
            value = fn(NAME, *args, environ={NAME: text})
        except ConfigError as exc:
            assert exc.variable == NAME
            continue
        if text.strip():
            assert args[1] <= value <= args[2]
            assert text.strip(" \t\r\n").isascii()
