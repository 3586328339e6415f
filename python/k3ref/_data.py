"""The data files k3ref ships (policy/*.json): next to the package's modules in an installed
package, else in the checkout's policy/ folder (python/k3ref/ -> policy/)."""
from pathlib import Path


def shipped_file(name: str, what: str) -> Path:
    """The path of the shipped data file `name`; FileNotFoundError naming both places looked in
    (`what` says which file, e.g. "policy table")."""
    here = Path(__file__).resolve().parent
    places = (here / name, here.parent.parent / "policy" / name)
    for p in places:
        if p.is_file():
            return p
    raise FileNotFoundError(f"k3ref {what} not found: looked for {places[0]} and {places[1]}")
