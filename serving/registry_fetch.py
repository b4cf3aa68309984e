"""Registry versions to drafters: download, validate and build, off the decode thread.

``RegistryFetch.fetch(version)`` downloads the version's artifact from the MLflow registry into a
temporary directory, has the ``ArtifactDrafterLoader`` check it (target fingerprint, checksum,
shapes, finite weights) and build the drafter, and deletes the download. All of it runs on a
background thread niced below serving (``BackgroundWorker``): a load competes with the decode steps
for the same cores. Failures come back as the Swapper's errors (serving/swap_errors.py).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import TYPE_CHECKING

from feedback.background.priority import BackgroundWorker
from serving.swap_errors import RefusedArtifact, RegistryUnavailable, UnknownVersion

if TYPE_CHECKING:  # annotation only: any loader with ``load(path, current)`` (SGLang's too)
    from serving.artifact_loader import ArtifactDrafterLoader


def registry_version(version: str) -> str:
    """``version`` as the registry numbers its versions ("7"; " 07" is 7 too). Raises UnknownVersion
    for anything else, before any download (a typo is no registry outage)."""
    text = str(version).strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise UnknownVersion(f"no drafter version {version!r}: registry versions are whole numbers "
                             "from 1")
    return str(int(text))


def is_registry_version(version: str) -> bool:
    """Whether ``version`` names a registry version as the registry writes it ("7", not "day0")."""
    try:
        return registry_version(version) == str(version)
    except UnknownVersion:
        return False


class RegistryFetch:
    """``registry``: feedback.registry.drafter_registry.DrafterRegistry or None (then every fetch
    raises RegistryUnavailable); ``nice``: how much nicer than the process the loader thread runs."""

    def __init__(self, registry, loader: ArtifactDrafterLoader, tenant: str, nice: int):
        self.registry, self.loader, self.tenant = registry, loader, tenant
        self.seen: set[str] = set()
        """Versions the registry had (downloaded, whether or not refused): the ones whose alias
        and metrics the Swapper may write."""
        self._worker = BackgroundWorker("drafter-load", nice, "drafter loader")

    def fetch(self, version: str, current):
        """The drafter of ``version``, built beside ``current`` (whose frozen parts it may share).
        Raises UnknownVersion, RegistryUnavailable, or RefusedArtifact (whose ``__cause__`` says
        what the check found)."""
        if self.registry is None:
            raise RegistryUnavailable("no drafter registry configured")
        return self._worker.submit(self._fetch_now, version, current).result()

    def stop(self) -> None:
        self._worker.stop()

    def _fetch_now(self, version: str, current):
        # the download only lives until the loader has read it into memory (a swap would otherwise
        # leave a copy of the artifact on disk: ~130 MB for a SmolLM2 standalone drafter)
        tmp = tempfile.mkdtemp(prefix=f"specloop-{self.tenant}-v{version}-")
        try:
            return self._build(version, self._download(version, tmp), current)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _download(self, version: str, into: str) -> str:
        from mlflow.exceptions import MlflowException

        try:
            path, _ = self.registry.download(self.tenant, version, into)
        except MlflowException as e:
            if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(e).lower():
                raise UnknownVersion(f"tenant {self.tenant!r} has no drafter version {version!r}") from e
            raise RegistryUnavailable(f"registry error fetching version {version}: {e}") from e
        except Exception as e:
            raise RegistryUnavailable(f"registry unavailable fetching version {version}: {e}") from e
        self.seen.add(version)
        return path

    def _build(self, version: str, path: str, current):
        from feedback.registry.artifact import DrafterArtifactError

        try:
            return self.loader.load(path, current)
        # RuntimeError / MemoryError too (torch's, e.g. an artifact whose shapes allocate more than
        # this host has): a version that cannot be built is refused like one that fails its checks,
        # where it used to escape as a 500, and on the Swapper's thread mark /health down each poll
        except (DrafterArtifactError, ValueError, TypeError, KeyError, RuntimeError, MemoryError) as e:
            raise RefusedArtifact(f"drafter version {version} refused: {e}") from e
