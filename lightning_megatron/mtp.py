"""What "MTP" means, in one place: which parameters are MTP, and which library versions can train them."""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

MTP_TRAINING_MINIMUM_VERSIONS = {"megatron-core": "0.19.0", "megatron-bridge": "0.6.0"}


def is_mtp_parameter(name: str) -> bool:
    """A parameter is MTP when a module on its path (not the parameter itself) is named `mtp`."""
    return "mtp" in name.split(".")[:-1]


def check_mtp_training_versions(installed: dict[str, str | None] | None = None) -> None:
    """Raise unless megatron-core and megatron-bridge are new enough for native MTP training.

    Pre-releases of a minimum (`0.19.0rc1`) are rejected; local builds of it (`0.19.0+vendor.1`) pass.
    """
    for package, minimum in MTP_TRAINING_MINIMUM_VERSIONS.items():
        version = installed[package] if installed is not None else _installed_version(package)
        if version is None:
            raise RuntimeError(f"MTP training needs {package}>={minimum}, which is not installed")
        if Version(version) < Version(minimum):
            raise RuntimeError(f"MTP training needs {package}>={minimum}; found {package}=={version}")


def _installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
