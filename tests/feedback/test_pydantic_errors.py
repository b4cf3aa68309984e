"""first_settings_error: either error a settings class raises for a bad environment value, in one
line. pydantic-settings' SettingsError (a value it could not parse) names only the field: the
variable is named where it can be told, else the field, and the parser's complaint follows."""

from __future__ import annotations

import pytest
from pydantic_settings import BaseSettings, SettingsConfigDict

from feedback.pydantic_errors import first_settings_error


class Things(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECLOOP_TEST_")
    things: dict[str, int] = {}
    count: int = 0


def error(**env) -> str:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        with pytest.raises(ValueError) as exc:  # ValidationError or SettingsError
            Things()
        return first_settings_error(exc.value)


def test_an_unparsable_value_names_its_variable_and_why():
    assert error(SPECLOOP_TEST_THINGS="[1,") == (
        "SPECLOOP_TEST_THINGS: could not be parsed: Expecting value: line 1 column 4 (char 3) (got '[1,')")


def test_the_field_is_named_where_the_variable_cannot_be_told():
    line = error(SPECLOOP_TEST_THINGS="[1,", SPECLOOP_OTHER_THINGS="{}")  # which one is Things'?
    assert line == ('error parsing value for field "things" from source "EnvSettingsSource": '
                    "Expecting value: line 1 column 4 (char 3)")


def test_a_validation_error_is_first_error():
    line = error(SPECLOOP_TEST_COUNT="abc")
    assert line.startswith("Things.count: Input should be a valid integer") and line.endswith("(got 'abc')")
