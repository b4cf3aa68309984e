#!/bin/sh
# Refuse the published default database password unless SPECLOOP_DEV_MODE is on
# (same rule as feedback/secrets.py applies to serving and the trainer).
case "${SPECLOOP_DEV_MODE:-0}" in
  1|true|True|TRUE|yes) ;;
  *)
    case "${POSTGRES_PASSWORD:-}" in
      ""|mlflow|change-me|changeme|password|secret|admin)
        echo "mlflow: refusing to start: POSTGRES_PASSWORD is a published default;" \
             "set a real one, or SPECLOOP_DEV_MODE=1 for a local dev setup" >&2
        exit 1 ;;
    esac ;;
esac
exec "$@"
