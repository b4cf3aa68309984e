"""Default secrets are refused outside a local dev mode.

docker-compose.yml ships working defaults so that ``docker compose up`` runs on a laptop
(``SPECLOOP_ADMIN_TOKEN=change-me``, the ``mlflow`` database password). Serving, the trainer and
the MLflow container check their secrets against this list at start-up and refuse to run with one
of them unless ``SPECLOOP_DEV_MODE`` is on, so a deployment cannot go live with a published
password by accident.
"""

from __future__ import annotations

from urllib.parse import urlsplit

DEFAULT_SECRETS = frozenset({"change-me", "changeme", "mlflow", "password", "secret", "admin"})


class DefaultSecretError(ValueError):
    """A setting holds a published default secret and dev mode is off."""


def check_secret(name: str, value: str | None, dev_mode: bool) -> None:
    if value is not None and not dev_mode and value.strip().lower() in DEFAULT_SECRETS:
        raise DefaultSecretError(
            f"{name} is the published default {value!r}: set a real secret, or SPECLOOP_DEV_MODE=1 "
            "for a local dev setup")


def check_uri_password(name: str, uri: str | None, dev_mode: bool) -> None:
    """The password inside a URI such as ``postgresql://mlflow:mlflow@db/mlflow``."""
    if not uri:
        return
    try:
        password = urlsplit(uri).password
    except ValueError:
        return
    check_secret(f"the password in {name}", password, dev_mode)
