#!/usr/bin/env bash
# Run test phases in order, time each, print a summary (each phase's wall time, the 10 slowest tests
# and molecule scenarios, the total against the 35-minute budget, one CPU's speed); exit non-zero if any phase failed.
# Phases: unit venvs mutation lint sanity package integration molecule controller-next.
# - integration splits in three: the modules marked `venvs` (real vLLM and speculators in the shared venvs that
#   the venvs phase builds) as integration-vllm (generation, extraction and training; the last two share one
#   extraction) and integration-pipeline (also marked `pipeline`: the whole pipelines, with servers of their
#   own), and integration-quick, the rest (which need no venvs). The two take about as long (the one that
#   ends last runs alone, on less than the machine's two cores). integration-nonroot (marked `nonroot`: an
#   account of its own runs make, downloading from PyPI) runs beside integration-quick rather than in it, so
#   a slow network stretches that test alone instead of the phase (on CI's machine it took 1245 s, here 293).
# - molecule splits in two: molecule-hosts, the scenarios without a vLLM server (default, gpu_fleet,
#   pipeline_transfer), and molecule-vllm, those with one (pipeline, vllm_server, which mount the venvs).
# - controller-next: the newest ansible-core on Python 3.13 in a trixie container (unit, sanity, molecule
#   default; scripts/controller_next.sh), its scenario taking turns with molecule-hosts' run of it.
# A group a+b+c runs its phases at once: a in the foreground, the others in the background, at nice 10, with
# their output kept in .cache/test-logs/<phase>.log and printed at the end. The next group starts when a ends;
# background phases run on to the end of the run, so a later group must not need them (a group's background
# phases fill the CPU that its foreground phase leaves idle: downloads in venvs, waits in integration).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1
export PATH="$ROOT/.venv/bin:$PATH" ANSIBLE_CONFIG="$ROOT/ansible.cfg" PYTHONUNBUFFERED=1
# what make test should take on CI's machine (2 cores); the summary warns above it
BUDGET_SECONDS=$((35 * 60))
LOGS="$ROOT/.cache/test-logs"
# scripts/molecule.sh appends "seconds<TAB>molecule SCENARIO" here, the pytest phases write junit files
export GPUFLOW_TEST_TIMES="$LOGS/times.tsv"

run_phase() {
    case "$1" in
        unit)        pytest -q --junitxml="$LOGS/junit-unit.xml" tests/unit ;;
        venvs)       python tests/integration/extract_env.py ;;
        mutation)    python tests/mutation_check.py ;;
        lint)        ansible-lint --profile production ;;
        sanity)      scripts/sanity.sh ;;
        package)     scripts/package_check.sh ;;
        integration) pytest -q --durations=12 --junitxml="$LOGS/junit-$1.xml" tests/integration ;;
        integration-quick) pytest -q -m "not venvs and not nonroot" --junitxml="$LOGS/junit-$1.xml" tests/integration ;;
        integration-nonroot) pytest -q -m nonroot --junitxml="$LOGS/junit-$1.xml" tests/integration ;;
        integration-vllm)  pytest -q -m "venvs and not pipeline" --durations=12 --junitxml="$LOGS/junit-$1.xml" tests/integration ;;
        integration-pipeline) pytest -q -m "venvs and pipeline" --durations=12 --junitxml="$LOGS/junit-$1.xml" tests/integration ;;
        molecule)    scripts/molecule.sh ;;
        molecule-hosts) scripts/molecule.sh default gpu_fleet pipeline_transfer ;;
        molecule-vllm)  scripts/molecule.sh pipeline vllm_server ;;
        controller-next) scripts/controller_next.sh ;;
    esac
}

for group in "$@"; do
    for phase in ${group//+/ }; do
        case "$phase" in
            unit|venvs|mutation|lint|sanity|package|integration|integration-quick|integration-nonroot) ;;
            integration-vllm|integration-pipeline) ;;
            molecule|molecule-hosts|molecule-vllm|controller-next) ;;
            *) echo "test.sh: unknown phase '$phase'" >&2; exit 2 ;;
        esac
    done
done

# Nothing is left running: a Docker engine this run starts (scripts/dockerd.sh, for molecule) is stopped
# at the end, one that was already running is left alone; then tests/leftovers.py fails the run when a
# process it started (a server, a holder, a container) is still there.
run_start=$(date +%s)
mkdir -p "$LOGS"
# One CPU's speed, before any phase starts: the same suite took 34 minutes on one machine of CI's kind and 60 on
# another (issue 27), and this figure, printed with the total, tells a slow machine from a slow change.
cpu_loop_seconds=$(python tools/cpu_loop.py 20000000)
rm -f "$LOGS"/junit-*.xml "$GPUFLOW_TEST_TIMES"
engine_before=0
timeout 10 docker info > /dev/null 2>&1 && engine_before=1
# the phases that need the engine would otherwise start it side by side
# and at nice 10, which the containers inherit: those beside the integration phase take the CPU it leaves
if [[ $engine_before == 0 && " ${*//+/ } " =~ \ (molecule|molecule-hosts|molecule-vllm|controller-next)\  ]]; then
    GPUFLOW_DOCKERD_NICE=10 scripts/dockerd.sh start || exit 1
fi

summary=()
failed=0
failed_phases=()
start_all=$SECONDS
background_all=()
for group in "$@"; do
    read -r -a phases <<< "${group//+/ }"
    background=("${phases[@]:1}")
    background_all+=("${background[@]}")
    for phase in "${background[@]}"; do
        echo "=== phase: $phase (in the background, from ${phases[0]} on; output in $LOGS/$phase.log) ==="
        (
            # below the foreground phase: integration's critical path (venv builds, vLLM start-up,
            # training) keeps the CPU, the background phases take what it leaves idle
            renice -n 10 -p "$BASHPID" > /dev/null
            start=$SECONDS
            if run_phase "$phase" > "$LOGS/$phase.log" 2>&1; then verdict=ok; else verdict=FAILED; fi
            printf '%s %d\n' "$verdict" $((SECONDS - start)) > "$LOGS/$phase.result"
        ) &
    done
    phase=${phases[0]}
    echo "=== phase: $phase ==="
    start=$SECONDS
    run_phase "$phase" 2>&1 | tee "$LOGS/$phase.log"
    if [[ ${PIPESTATUS[0]} == 0 ]]; then verdict=ok; else verdict=FAILED; failed=1; fi
    summary+=("$(printf '%-16s %-7s %5ds' "$phase" "$verdict" $((SECONDS - start)))")
    [[ $verdict == ok ]] || failed_phases+=("$phase")
done
wait
for phase in "${background_all[@]}"; do
    echo "=== phase: $phase (ran in the background) ==="
    cat "$LOGS/$phase.log"
    read -r verdict seconds < "$LOGS/$phase.result"
    [[ $verdict == ok ]] || { failed=1; failed_phases+=("$phase"); }
    summary+=("$(printf '%-16s %-7s %5ds' "$phase" "$verdict" "$seconds")")
done
echo "=== phase: leftovers ==="
[[ $engine_before == 1 ]] || scripts/dockerd.sh stop
if python tests/leftovers.py --since "$run_start" --root "$ROOT"; then verdict=ok; else verdict=FAILED; failed=1; fi
summary+=("$(printf '%-16s %-7s %5ds' leftovers "$verdict" 0)")
# CI shows only the tail of the output: each failed phase's last lines come again here
for phase in "${failed_phases[@]}"; do
    echo "=== the end of failed phase $phase's output ($LOGS/$phase.log) ==="
    tail -n 25 "$LOGS/$phase.log"
done
echo "=== summary ==="
printf '%s\n' "${summary[@]}"
total=$((SECONDS - start_all))
printf '%-16s %-7s %5ds (budget %ds)\n' total "$([[ $failed == 0 ]] && echo ok || echo FAILED)" "$total" "$BUDGET_SECONDS"
printf 'this machine: a 20-million-step Python loop took %s s of one CPU before the phases\n' "$cpu_loop_seconds"
python scripts/test_summary.py --top 10 "$GPUFLOW_TEST_TIMES" "$LOGS"/junit-*.xml
if ((total > BUDGET_SECONDS)); then
    printf 'WARNING: this run took %dm%02ds, over the %d-minute budget\n' $((total / 60)) $((total % 60)) $((BUDGET_SECONDS / 60))
fi
exit "$failed"
