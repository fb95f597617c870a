"""The integration tests' shared set-up: one extraction set-up for the extraction and the training tests."""
import pytest

from extract_env import SAMPLES, TRUNCATED, extraction_setup, stop_leftovers


def pytest_collection_modifyitems(items):
    """The extraction tests first: they complete the extraction that the training tests then train on (the
    role's rerun there starts nothing). Alone, the training tests run the extraction themselves."""
    items.sort(key=lambda item: 0 if item.module.__name__ == "test_hidden_state_extract" else 1)


@pytest.fixture(scope="session")
def extraction():
    """The tiny model, the token-exact rows, the simulated GPU and the role's variables (extract_env)."""
    info = extraction_setup("extraction", SAMPLES, TRUNCATED)
    yield info
    stop_leftovers(info)
