#!/usr/bin/env bash
# Runs a Python script with $DPAR_TEST_PYTHON (CI's venv, with the packages the checks need), else python3.
exec "${DPAR_TEST_PYTHON:-python3}" "$@"
