#!/bin/sh
# Refuse the published default database password unless SPECLOOP_DEV_MODE is on: the same rule
# feedback/secrets.py applies to serving and the trainer. Dev mode is on for the spellings pydantic
# reads as true (1, true, t, yes, y, on; any case); the password is compared trimmed and lower-cased
# with DEFAULT_SECRETS there (an empty one is refused too: PostgreSQL needs a password).
lower() { printf '%s' "$1" | tr '[:upper:]' '[:lower:]'; }
trim() { printf '%s' "$1" | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//'; }

case "$(lower "${SPECLOOP_DEV_MODE:-0}")" in
  1|true|t|yes|y|on) ;;
  *)
    case "$(lower "$(trim "${POSTGRES_PASSWORD:-}")")" in
      ""|change-me|changeme|mlflow|password|secret|admin)
        echo "mlflow: refusing to start: POSTGRES_PASSWORD is a published default;" \
             "set a real one, or SPECLOOP_DEV_MODE=1 for a local dev setup" >&2
        exit 1 ;;
    esac ;;
esac
exec "$@"
