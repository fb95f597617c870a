"""A report page as a person sees it: headless Chromium's screenshot, and what its pixels show.
Shared by the report's unit test and the local pipeline's end-to-end test."""
import os
import shutil
import subprocess

import numpy as np
import pytest
from matplotlib import image

# the figures' blue (disk bar, loss curve, acceptance bars), used on no other part of the page
FIGURE_BLUE = np.array([0x15, 0x65, 0xc0]) / 255


def screenshot(html, workdir, width=1280, height=4000):
    """RGB pixels of Chromium's screenshot of html; skips without Chromium unless GPUFLOW_REQUIRE_CHROMIUM."""
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("GPUFLOW_REQUIRE_CHROMIUM"):
            pytest.fail("GPUFLOW_REQUIRE_CHROMIUM is set but chromium is not installed (scripts/system_deps.sh)")
        pytest.skip("chromium is not installed (scripts/system_deps.sh installs it)")
    shot = os.path.join(str(workdir), "screenshot.png")
    try:
        proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               "--screenshot=%s" % shot, "--window-size=%d,%d" % (width, height), "file://" + html],
                              capture_output=True, text=True, timeout=120, check=False,
                              env=dict(os.environ, HOME=str(workdir)))  # its profile and caches stay in workdir
    except subprocess.TimeoutExpired:
        pytest.fail("chromium took more than 120 s and wrote no screenshot")
    assert os.path.exists(shot), proc.stderr[-3000:]
    return image.imread(shot)[..., :3]


def non_white_share(pixels):
    """Share of pixels that are not (almost) white, over the RGB channels."""
    return float((pixels[..., :3].min(axis=2) < 0.95).mean())


def figure_blue_share(pixels):
    """Share of pixels in the figures' blue: above zero only where the browser loaded the PNGs."""
    return float((np.abs(pixels[..., :3] - FIGURE_BLUE).max(axis=2) < 0.04).mean())
