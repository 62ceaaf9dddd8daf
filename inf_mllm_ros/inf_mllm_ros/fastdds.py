"""The Fast DDS profile for large raw frames, for the processes that publish or take them (the node, the
replay tool). Imports no rclpy; needs the package installed (its share folder holds the profile)."""

from __future__ import annotations

import os


def large_frames_env() -> dict[str, str]:
    """The environment that gives Fast DDS large shared-memory segments and socket buffers for raw frames
    (`config/fastdds_large_frames.xml`), unless a profile or transport is chosen already: then nothing."""
    if os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE") or os.environ.get("FASTDDS_BUILTIN_TRANSPORTS"):
        return {}
    from ament_index_python.packages import PackageNotFoundError, get_package_share_directory

    try:
        share = get_package_share_directory("inf_mllm_ros")
    except PackageNotFoundError:  # run from a source tree: Fast DDS's defaults
        return {}
    profile = os.path.join(share, "config", "fastdds_large_frames.xml")
    return {"FASTDDS_DEFAULT_PROFILES_FILE": profile} if os.path.isfile(profile) else {}
