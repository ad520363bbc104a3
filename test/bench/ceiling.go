package bench

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// The machine's ceiling for a 1 MiB workload.
//
// On a machine with few CPUs a 1 MiB READ or WRITE is mostly the kernel's
// copy between the file's pages and guest memory, and two threads copying
// at once share one memory bus: a daemon cannot be faster than the copies
// themselves. Ceiling measures those copies with nothing else in the way:
// the daemon's own system call (one pwritev or preadv of 256 4-KiB
// segments of a shared memory mapping, the guest's pages) on the same
// data files, from threads of this process, no front end, no rings and no
// daemon. A ratio to it says how much of what the machine allows a daemon
// delivers, which a ratio between two daemons cannot.

// ceilingSegment is the segment size: one guest page per descriptor, as
// the front end lays out its requests.
const ceilingSegment = 4096

// HasCeiling reports whether Ceiling measures w: sequential 1 MiB-class
// transfers, whose cost is the copy. For small requests the transport is
// the cost, and the bare system calls would say nothing about a daemon.
func HasCeiling(w Workload) bool {
	return (w.Kind == SeqWrite || w.Kind == SeqRead) && w.Size >= 64<<10 && w.Size%ceilingSegment == 0
}

// CeilingResult is one ceiling measurement, in bytes per second: with one
// thread (what a daemon serving a ring on one thread could reach) and with
// one thread per CPU.
type CeilingResult struct {
	One, All float64
	CPUs     int
}

// Best is the better of the two.
func (c CeilingResult) Best() float64 { return max(c.One, c.All) }

// Ceiling runs w's transfers on the data files in share, from depth
// buffers, with 1 thread and with one per CPU, each for d. Each thread works
// its own files (thread t takes files t, t+n, ... of w's, round-robin, as
// the front end spreads requests), or the one file when w has one.
func Ceiling(share string, fileSize uint64, w Workload, depth int, d time.Duration) (CeilingResult, error) {
	if !HasCeiling(w) {
		return CeilingResult{}, fmt.Errorf("no ceiling for %s", w.Name)
	}
	if fileSize < uint64(w.Size) {
		return CeilingResult{}, fmt.Errorf("ceiling: files of %d bytes for %d-byte requests", fileSize, w.Size)
	}
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	for i := range w.Files {
		fd, err := unix.Open(filepath.Join(share, dataName(i)), unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return CeilingResult{}, fmt.Errorf("ceiling: open %s: %w", dataName(i), err)
		}
		fds = append(fds, fd)
	}
	counts := []int{1}
	if n := runtime.NumCPU(); n > 1 {
		counts = append(counts, n)
	}
	// Guest memory as the front end makes and lays it out (test/vmm's
	// shared memfd mapping, every page touched): depth buffers of w.Size,
	// their pages shuffled so that no two segments of a request are
	// adjacent, dealt out among the threads.
	bufs := max(depth, counts[len(counts)-1])
	pages := bufs * w.Size / ceilingSegment
	gm, err := vmm.NewMemory([]vmm.RegionSpec{{Size: uint64(pages * ceilingSegment)}})
	if err != nil {
		return CeilingResult{}, fmt.Errorf("ceiling: %w", err)
	}
	defer gm.Close()
	mem := gm.Regions()[0].Host()
	for i := 0; i < len(mem); i += ceilingSegment {
		mem[i] = byte(i >> 12)
	}
	order := rand.New(rand.NewPCG(1, 2)).Perm(pages)
	segs := make([][]byte, pages)
	for i, p := range order {
		segs[i] = mem[p*ceilingSegment : (p+1)*ceilingSegment]
	}
	perBuf := w.Size / ceilingSegment
	res := CeilingResult{CPUs: counts[len(counts)-1]}
	for _, n := range counts {
		var moved atomic.Int64
		var stop atomic.Bool
		errs := make([]error, n)
		var wg sync.WaitGroup
		for t := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				var iovs [][][]byte
				for b := t; b < bufs; b += n {
					iovs = append(iovs, segs[b*perBuf:(b+1)*perBuf])
				}
				var mine []int
				for i := t % len(fds); i < len(fds); i += n {
					mine = append(mine, fds[i])
				}
				if len(mine) == 0 { // more threads than files
					mine = []int{fds[t%len(fds)]}
				}
				offs := make([]uint64, len(mine))
				for k := 0; !stop.Load(); k++ {
					i := k % len(mine)
					var got int
					var err error
					if w.Kind == SeqWrite {
						got, err = unix.Pwritev(mine[i], iovs[k%len(iovs)], int64(offs[i]))
					} else {
						got, err = unix.Preadv(mine[i], iovs[k%len(iovs)], int64(offs[i]))
					}
					if err != nil {
						errs[t] = fmt.Errorf("ceiling: %s: %w", w.Name, err)
						return
					}
					moved.Add(int64(got))
					if offs[i] += uint64(w.Size); offs[i]+uint64(w.Size) > fileSize {
						offs[i] = 0
					}
				}
			}()
		}
		start := time.Now()
		time.Sleep(d)
		stop.Store(true)
		wg.Wait()
		el := time.Since(start)
		for _, err := range errs {
			if err != nil {
				return CeilingResult{}, err
			}
		}
		r := float64(moved.Load()) / el.Seconds()
		if n == 1 {
			res.One = r
		}
		res.All = r
	}
	return res, nil
}
