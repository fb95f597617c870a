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
# the programs under roles/*/files import the job library that their roles install beside them on a host; run from
# the checkout (imported here, or started as a subprocess) they find it here
JOB_LIBRARY_DIR = os.path.join(REPO_ROOT, "roles", "detached_job", "files")
if JOB_LIBRARY_DIR not in sys.path:
    sys.path.insert(0, JOB_LIBRARY_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [JOB_LIBRARY_DIR, os.environ.get("PYTHONPATH")]))
# helpers shared by the unit and integration tests (report_screenshot)
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
