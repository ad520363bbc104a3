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
	ok := func(ops uint64) Cell { return Cell{Res: &Result{Ops: ops, Elapsed: time.Second}} }
	failed := Cell{Err: errors.New("daemon died")}
	refs := []string{"ref-pool0", "ref-pool2"}
	for _, tc := range []struct {
		name  string
		cells map[string][]Cell
		want  float64
		ok    bool
	}{
		{"best reference per round", map[string][]Cell{
			"ours":      {ok(300), ok(150), ok(200)},
			"ref-pool0": {ok(200), ok(100), ok(50)},
			"ref-pool2": {ok(100), ok(50), ok(100)},
		}, 1.5, true},
		// One round's odd ratio (2.0) does not move the median.
		{"outlier round", map[string][]Cell{
			"ours":      {ok(200), ok(100), ok(210)},
			"ref-pool0": {ok(180), ok(50), ok(200)},
		}, 1.11, true},
		// An even count takes the upper of the two middle ratios, as
		// median does for rates.
		{"even rounds", map[string][]Cell{
			"ours":      {ok(100), ok(120), ok(130), ok(140)},
			"ref-pool0": {ok(100), ok(100), ok(100), ok(100)},
		}, 1.3, true},
		{"failed rounds left out", map[string][]Cell{
			"ours":      {failed, ok(100), ok(300)},
			"ref-pool0": {ok(100), failed, ok(100)},
			"ref-pool2": {ok(100), failed, failed},
		}, 3, true},
		{"no reference", map[string][]Cell{"ours": {ok(100)}}, 0, false},
		{"references with fewer rounds", map[string][]Cell{
			"ours":      {ok(100), ok(100)},
			"ref-pool2": {ok(50)},
		}, 2, true},
	} {
		got, ok := pairedRatio(tc.cells, w, "ours", refs)
		if ok != tc.ok || ok && (got < tc.want-0.01 || got > tc.want+0.01) {
			t.Errorf("%s: got %.3f, %v; want %.2f, %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}
