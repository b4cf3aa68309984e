"""API keys -> tenants: who a request is, so that a client cannot claim another tenant's index.

With ``api_keys`` configured (``SPECLOOP_API_KEYS='{"sk-...": "acme"}'``) every /v1 request needs
``Authorization: Bearer <key>`` (401 in OpenAI's shape without a known key); the request's tenant
is its key's, and a body naming another tenant is refused (403). Without keys (local dev) the body's
``tenant`` is taken as given, ``default`` when absent. The tenant selects the per-tenant suffix
index (feedback/suffix/index.py) and the tenant's traces; the learned drafter is per server (each
server follows ``settings.tenant``'s registry versions).
"""

from __future__ import annotations

import hmac

from serving.api.errors import APIError


def resolve_tenant(api_keys: dict[str, str], authorization: str | None, claimed: str | None) -> str:
    if not api_keys:
        return claimed or "default"
    scheme, _, given = (authorization or "").partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        raise APIError("You didn't provide an API key: send `Authorization: Bearer <key>`", 401,
                       "invalid_request_error", code="invalid_api_key")
    tenant = None
    for key, owner in api_keys.items():  # compare every key: the time taken does not tell which
        if hmac.compare_digest(given.encode(), key.encode()):
            tenant = owner
    if tenant is None:
        raise APIError("Incorrect API key provided", 401, "invalid_request_error", code="invalid_api_key")
    if claimed is not None and claimed != tenant:
        raise APIError(f"this API key belongs to tenant {tenant!r}; it cannot act as {claimed!r}",
                       403, "permission_error", param="tenant", code="tenant_mismatch")
    return tenant
