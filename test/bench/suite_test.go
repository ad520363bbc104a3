package bench

import (
	"errors"
	"testing"
	"time"
)

// TestPairedRatio: each round's rate is divided by the best reference of
// the same round, failed rounds are left out, and the median is taken.
func TestPairedRatio(t *testing.T) {
	w := Workload{Name: "randread", Kind: RandRead, Size: 4 << 10, Files: 4}
	run := func(ops uint64) Cell { return Cell{Res: &Result{Ops: ops, Elapsed: time.Second}} }
	failed := Cell{Err: errors.New("daemon died")}
	refs := []string{"ref-pool0", "ref-pool2"}
	for _, tc := range []struct {
		name  string
		cells map[string][]Cell
		want  float64
		ok    bool
	}{
		{"best reference per round", map[string][]Cell{
			"ours":      {run(300), run(150), run(200)},
			"ref-pool0": {run(200), run(100), run(50)},
			"ref-pool2": {run(100), run(50), run(100)},
		}, 1.5, true},
		// One round's odd ratio (2.0) does not move the median.
		{"outlier round", map[string][]Cell{
			"ours":      {run(200), run(100), run(210)},
			"ref-pool0": {run(180), run(50), run(200)},
		}, 1.11, true},
		// An even count takes the upper of the two middle ratios, as
		// median does for rates.
		{"even rounds", map[string][]Cell{
			"ours":      {run(100), run(120), run(130), run(140)},
			"ref-pool0": {run(100), run(100), run(100), run(100)},
		}, 1.3, true},
		{"failed rounds left out", map[string][]Cell{
			"ours":      {failed, run(100), run(300)},
			"ref-pool0": {run(100), failed, run(100)},
			"ref-pool2": {run(100), failed, failed},
		}, 3, true},
		{"no reference", map[string][]Cell{"ours": {run(100)}}, 0, false},
		{"references with fewer rounds", map[string][]Cell{
			"ours":      {run(100), run(100)},
			"ref-pool2": {run(50)},
		}, 2, true},
	} {
		got, found := pairedRatio(tc.cells, w, "ours", refs)
		if found != tc.ok || found && (got < tc.want-0.01 || got > tc.want+0.01) {
			t.Errorf("%s: got %.3f, %v; want %.2f, %v", tc.name, got, found, tc.want, tc.ok)
		}
	}
}
