"""Shared pytest set-up: import the collection from the checkout as ansible_collections.gpuflow.eagle3."""
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIONS_DIR = os.path.join(REPO_ROOT, ".cache", "collections")
LINK = os.path.join(COLLECTIONS_DIR, "ansible_collections", "gpuflow", "eagle3")

if not os.path.islink(LINK):
    os.makedirs(os.path.dirname(LINK), exist_ok=True)
    try:
        os.symlink(os.path.join("..", "..", "..", ".."), LINK)
    except FileExistsError:  # make test starts pytest sessions side by side
        pass
if COLLECTIONS_DIR not in sys.path:
    sys.path.insert(0, COLLECTIONS_DIR)
os.environ.setdefault("ANSIBLE_CONFIG", os.path.join(REPO_ROOT, "ansible.cfg"))
# helpers shared by the unit and integration tests (report_screenshot)
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
