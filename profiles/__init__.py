"""YAML data shipped with flagdeploy: bundled models, chip specs, deployment profiles."""

from pathlib import Path

PROFILES_DIR = Path(__file__).parent
