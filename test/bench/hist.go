package bench

import (
	"math/bits"
	"time"
)

// hist is a log-linear latency histogram in nanoseconds: exact below 128
// ns, then 64 buckets per power of two (under 1.6% relative error). It
// never allocates after creation.
type hist struct {
	b     [128 + 40*64]uint64
	n     uint64
	max   uint64
	total uint64
}

func histIndex(v uint64) int {
	if v < 128 {
		return int(v)
	}
	e := bits.Len64(v) - 7 // v>>e is in [64, 128)
	i := 128 + (e-1)*64 + int(v>>e) - 64
	if i >= len(hist{}.b) {
		i = len(hist{}.b) - 1
	}
	return i
}

// histValue is the middle of bucket i.
func histValue(i int) uint64 {
	if i < 128 {
		return uint64(i)
	}
	e := (i-128)/64 + 1
	k := uint64((i-128)%64 + 64)
	return k<<e + (uint64(1)<<e)/2
}

func (h *hist) add(ns int64) {
	if ns < 0 {
		ns = 0
	}
	v := uint64(ns)
	h.b[histIndex(v)]++
	h.n++
	h.total += v
	if v > h.max {
		h.max = v
	}
}

func (h *hist) merge(o *hist) {
	for i, c := range o.b {
		h.b[i] += c
	}
	h.n += o.n
	h.total += o.total
	h.max = max(h.max, o.max)
}

// quantile returns the q-quantile (0 < q <= 1).
func (h *hist) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	want := uint64(q * float64(h.n))
	if want == 0 {
		want = 1
	}
	var c uint64
	for i, k := range h.b {
		c += k
		if c >= want {
			return time.Duration(histValue(i))
		}
	}
	return time.Duration(h.max)
}
