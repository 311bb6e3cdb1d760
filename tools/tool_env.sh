# The one builder of the virtualenvs that Fathom's tools run in apart from its own (vLLM's,
# llmcompressor's): each pins its own torch and transformers. Sourced by tools/vllm_env.sh and
# tools/quantize_env.sh, which say what goes in and how to check it.
#
# An env lives outside the clone at a path that names its version: a new version gets a new env
# and an old one is never half-upgraded. It counts as ready only when its marker file exists, and
# the marker is written only after the tool's import check passed, so an interrupted install is
# redone rather than trusted. One builder at a time (a lock beside the env): make run and make
# test may start together.

# pip, without the notices about local index folders this machine lacks.
quiet_pip() {
    "$ENV_DIR/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
}

# build_tool_env WHAT HOW_LONG: build $ENV_DIR from $BASE_PYTHON if it is not ready, running the
# caller's install_tool and check_tool; print the env's python as the last line.
build_tool_env() {
    local what=$1 how_long=$2 marker="$ENV_DIR/.fathom-ready"
    if [[ -f "$marker" ]]; then
        echo "$ENV_DIR/bin/python"
        return 0
    fi
    mkdir -p "$(dirname "$ENV_DIR")"
    exec 9>"$ENV_DIR.lock"
    flock 9
    if [[ ! -f "$marker" ]]; then
        echo "building the $what env in $ENV_DIR ($how_long)" >&2
        rm -rf "$ENV_DIR"
        "$BASE_PYTHON" -m venv "$ENV_DIR"
        quiet_pip install --quiet --upgrade pip
        install_tool
        check_tool
        touch "$marker"
    fi
    exec 9>&-
    echo "$ENV_DIR/bin/python"
}
