"""Maps the top-level folders onto one import package: laminar/, bus/ as laminar.bus, roles/ as
laminar.roles (side by side so the layout shows the roles; docs/architecture.md §1)."""
import os

from setuptools import setup

ROOTS = {"laminar": "laminar", "laminar.bus": "bus", "laminar.roles": "roles"}


def _packages():
    found = {}
    for pkg, folder in ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, folder)
                name = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
                found[name] = dirpath
    return found


PACKAGES = _packages()
setup(packages=sorted(PACKAGES), package_dir=PACKAGES)
