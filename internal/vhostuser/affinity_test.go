package vhostuser

import (
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

func cpuSet(cpus ...int) *unix.CPUSet {
	var s unix.CPUSet
	for _, c := range cpus {
		s.Set(c)
	}
	return &s
}

func cpuList(s *unix.CPUSet) []int {
	if s == nil {
		return nil
	}
	var l []int
	for c := range len(s) * 64 {
		if s.IsSet(c) {
			l = append(l, c)
		}
	}
	return l
}

func TestDealCPUs(t *testing.T) {
	for _, tc := range []struct {
		name    string
		all     *unix.CPUSet
		running []int
		want    map[int][]int // ring index: its share; absent: none
	}{
		{"one ring", cpuSet(0, 1, 2, 3), []int{1}, nil},
		{"no rings", cpuSet(0, 1), nil, nil},
		{"one CPU", nil, []int{1, 2}, nil},
		{"two rings, two CPUs", cpuSet(0, 1), []int{1, 2}, map[int][]int{1: {0}, 2: {1}}},
		{"two rings, a sparse set", cpuSet(2, 5, 7, 9, 64), []int{1, 2},
			map[int][]int{1: {2, 7, 64}, 2: {5, 9}}},
		{"dealt by running position", cpuSet(0, 1, 2, 3), []int{2, 5},
			map[int][]int{2: {0, 2}, 5: {1, 3}}},
		{"more rings than CPUs", cpuSet(4, 6), []int{1, 2, 3},
			map[int][]int{1: {4}, 2: {6}, 3: {4}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := dealCPUs(tc.all, tc.running)
			if p.all != tc.all {
				t.Errorf("all = %v, want %v", cpuList(p.all), cpuList(tc.all))
			}
			for i := range MaxRings {
				got, want := cpuList(p.share[i]), tc.want[i]
				if !slices.Equal(got, want) {
					t.Errorf("ring %d: share %v, want %v", i, got, want)
				}
			}
		})
	}
}

// TestRingServersKeepToTheirCPUs: with two request rings running, each
// ring's server serves small requests on its ring's share of the CPUs, a
// large one anywhere, and small ones on its share again only after
// cheapToPin of them in a row; once one ring stops, the other's server
// runs anywhere again.
func TestRingServersKeepToTheirCPUs(t *testing.T) {
	all := allCPUs()
	if all == nil {
		t.Skip("needs two CPUs or more")
	}
	p, d := startProbeRings(t, 2, 0, 8)
	// SET_VRING_ENABLE has no reply: a round trip makes sure the message
	// loop has started both rings.
	if _, err := d.Conn.GetFeatures(); err != nil {
		t.Fatal(err)
	}
	plan := dealCPUs(all, []int{1, 2})
	served := func(ring int, heavy bool) []int {
		p.mu.Lock()
		defer p.mu.Unlock()
		s, ok := p.cpus[probeKind{ring, heavy}]
		if !ok {
			return nil
		}
		return cpuList(&s)
	}
	check := func(when string, ring int, heavy bool, want *unix.CPUSet) {
		t.Helper()
		if got := served(ring, heavy); !slices.Equal(got, cpuList(want)) {
			t.Errorf("%s: ring %d served (heavy %v) on CPUs %v, want %v", when, ring, heavy, got, cpuList(want))
		}
	}
	cheap := func(n int) [][40]byte {
		return slices.Repeat([][40]byte{request(0, false, 0)}, n)
	}
	for ring := 1; ring <= 2; ring++ {
		submitOn(t, d, ring, cheap(1))
		check("two rings running", ring, false, plan.share[ring])
	}
	submitOn(t, d, 1, [][40]byte{request(7, true, 0)})
	check("a large request", 1, true, all)
	submitOn(t, d, 1, cheap(1))
	check("a small request after a large one", 1, false, all)
	submitOn(t, d, 1, cheap(cheapToPin))
	check("small requests in a row after a large one", 1, false, plan.share[1])

	// GET_VRING_BASE answers once ring 2 has stopped, and the message loop
	// deals the CPUs again before it answers; ring 1's server follows
	// when it next wakes.
	if _, err := d.StopQueue(2); err != nil {
		t.Fatal(err)
	}
	submitOn(t, d, 1, cheap(1))
	check("ring 2 stopped", 1, false, all)
}
