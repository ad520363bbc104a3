#!/bin/bash
# Runs each fuzz target given as pkg:Target for FUZZTIME (default 60s).
#
# `go test -fuzz` sometimes ends a clean run with "context deadline
# exceeded" when -fuzztime expires while a worker is still minimizing a
# new input on a loaded machine; that is not a finding. A real failure
# always writes its input ("Failing input written to ..."), so only that,
# or any other error, fails this script.
set -uo pipefail
FUZZTIME=${FUZZTIME:-60s}
GO=${GO:-go}
status=0
for t in "$@"; do
	pkg=${t%%:*}
	name=${t##*:}
	echo "== fuzz $name ($pkg) for $FUZZTIME"
	out=$(mktemp)
	"$GO" test -run='^$' -fuzz="^${name}\$" -fuzztime="$FUZZTIME" "$pkg" 2>&1 | tee "$out"
	rc=${PIPESTATUS[0]}
	if ((rc != 0)); then
		if ! grep -q 'Failing input written' "$out" &&
			grep -q 'context deadline exceeded' "$out" &&
			! grep -q 'panic:' "$out"; then
			echo "== $name: fuzzing stopped at the deadline while minimizing; no failing input (Go toolchain quirk), counted as a pass"
		else
			status=1
		fi
	fi
	rm -f "$out"
done
exit $status
