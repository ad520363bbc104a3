package bench

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// nullDevice is an in-process device that answers every request at once
// without touching data: it walks the chain's indirect table, writes the
// out header (and fuse_write_out.size for WRITE), returns the chain with
// its whole writable length, and notifies per EVENT_IDX. Driving it
// measures the front end alone: its request rate ceiling and its CPU cost
// per request.
type nullDevice struct {
	mem                *vmm.Memory
	desc, avail, used  []byte
	size, mask         uint16
	kick, call         int
	lastAvail, usedIdx uint16
	stop               atomic.Bool
	done               chan struct{}
	// For a stalled run's report (Target.DeviceDiag).
	signals, wakeups atomic.Uint64
	polled           atomic.Uint32 // lastAvail when the device last went to sleep
	// To test how a stalled run is reported: the device sends at most
	// maxSignals signals and serves at most maxServed chains (-1: no
	// limit, as NullTarget sets them).
	maxSignals, maxServed atomic.Int64
	served                int64
}

func (d *nullDevice) availIdx() uint16 {
	return uint16(atomic.LoadUint32((*uint32)(unsafe.Pointer(&d.avail[0]))) >> 16)
}

func (d *nullDevice) usedEvent() uint16 {
	return uint16(atomic.LoadUint32((*uint32)(unsafe.Pointer(&d.avail[4+2*int(d.size)]))))
}

func (d *nullDevice) setAvailEvent(v uint16) {
	atomic.StoreUint32((*uint32)(unsafe.Pointer(&d.used[4+8*int(d.size)])), uint32(v))
}

func (d *nullDevice) run() {
	defer close(d.done)
	var b [8]byte
	for !d.stop.Load() {
		if d.drain() {
			continue
		}
		d.setAvailEvent(d.lastAvail)
		if d.availIdx() != d.lastAvail && !d.frozen() {
			continue
		}
		d.polled.Store(uint32(d.lastAvail))
		p := []unix.PollFd{{Fd: int32(d.kick), Events: unix.POLLIN}}
		unix.Poll(p, 10)
		unix.Read(d.kick, b[:])
		d.wakeups.Add(1)
	}
}

func (d *nullDevice) frozen() bool {
	m := d.maxServed.Load()
	return m >= 0 && d.served >= m
}

func (d *nullDevice) host(gpa uint64, n uint32) []byte {
	h, err := d.mem.Slice(gpa, uint64(n))
	if err != nil {
		panic(err)
	}
	return h
}

func (d *nullDevice) drain() bool {
	end := d.availIdx()
	if d.frozen() {
		return false
	}
	if m := d.maxServed.Load(); m >= 0 && int64(end-d.lastAvail) > m-d.served {
		end = d.lastAvail + uint16(m-d.served)
	}
	if end == d.lastAvail {
		return false
	}
	d.served += int64(end - d.lastAvail)
	old := d.usedIdx
	for ; d.lastAvail != end; d.lastAvail++ {
		head := le.Uint16(d.avail[4+2*int(d.lastAvail&d.mask):])
		hd := d.desc[int(head)*16:]
		addr, n, flags := le.Uint64(hd), le.Uint32(hd[8:]), le.Uint16(hd[12:])
		if flags&vmm.DescIndirect == 0 {
			panic("null device: direct chain")
		}
		table := d.host(addr, n)
		var in, args, outHdr, out []byte
		var wlen uint32
		for i := 0; i+16 <= len(table); i += 16 {
			e := table[i:]
			a, l, f := le.Uint64(e), le.Uint32(e[8:]), le.Uint16(e[12:])
			switch {
			case f&vmm.DescWrite == 0 && in == nil:
				in = d.host(a, l)
			case f&vmm.DescWrite == 0 && args == nil:
				args = d.host(a, l)
			case f&vmm.DescWrite != 0 && outHdr == nil:
				outHdr = d.host(a, l)
			case f&vmm.DescWrite != 0 && out == nil:
				out = d.host(a, l)
			}
			if f&vmm.DescWrite != 0 {
				wlen += l
			}
		}
		le.PutUint32(outHdr, wlen)
		le.PutUint32(outHdr[4:], 0)
		le.PutUint64(outHdr[8:], le.Uint64(in[8:]))
		if le.Uint32(in[4:]) == vmm.OpWrite {
			le.PutUint32(out, le.Uint32(args[16:]))
		}
		e := d.used[4+8*int(d.usedIdx&d.mask):]
		le.PutUint32(e, uint32(head))
		le.PutUint32(e[4:], wlen)
		d.usedIdx++
	}
	w := (*uint32)(unsafe.Pointer(&d.used[0]))
	atomic.StoreUint32(w, atomic.LoadUint32(w)&0xffff|uint32(d.usedIdx)<<16)
	if vmm.NeedEvent(d.usedEvent(), d.usedIdx, old) {
		if m := d.maxSignals.Load(); m >= 0 && int64(d.signals.Load()) >= m {
			return true
		}
		d.signals.Add(1)
		var b [8]byte
		le.PutUint64(b[:], 1)
		unix.Write(d.call, b[:])
	}
	return true
}

// NullTarget is a Target of nrings request rings served by null devices.
func NullTarget(nrings int, queueSize uint16, bufMiB uint64) (*Target, func(), error) {
	mem, err := vmm.NewMemory(vmm.SplitLayout(16*vmm.MiB, bufMiB*vmm.MiB))
	if err != nil {
		return nil, nil, err
	}
	t := &Target{Mem: mem, BufRegion: 1, FileSize: 256 << 20,
		Init: &vmm.InitOut{MaxWrite: 1 << 20}}
	for i := range dataFiles {
		t.Files = append(t.Files, FileRef{NodeID: uint64(2 + i), FH: uint64(i)})
	}
	var queues []*vmm.Queue
	stop := func() {
		for _, d := range t.null {
			d.stop.Store(true)
			<-d.done
		}
		for _, q := range queues {
			q.Close()
		}
		for _, r := range t.Rings {
			r.Close()
		}
		mem.Close()
	}
	for i := range nrings {
		q, err := vmm.NewQueue(mem, 1+i, vmm.QueueConfig{Size: queueSize, EventIdx: true, Indirect: true, BufRegion: 1})
		if err != nil {
			stop()
			return nil, nil, err
		}
		queues = append(queues, q)
		r, err := newRing(mem, q, true)
		if err != nil {
			stop()
			return nil, nil, err
		}
		t.Rings = append(t.Rings, r)
		kick := r.kickFd
		d := &nullDevice{mem: mem, desc: r.desc, avail: r.avail, used: r.used, size: r.size, mask: r.mask,
			kick: kick, call: r.call, done: make(chan struct{})}
		d.maxSignals.Store(-1)
		d.maxServed.Store(-1)
		t.null = append(t.null, d)
		go d.run()
	}
	t.DeviceDiag = func() string {
		var out []string
		for i, d := range t.null {
			out = append(out, fmt.Sprintf("null device %d: avail seen %d at its last sleep, %d signals, %d polls",
				i+1, d.polled.Load(), d.signals.Load(), d.wakeups.Load()))
		}
		return strings.Join(out, "; ")
	}
	return t, stop, nil
}

// NullSuite measures the front end against null devices for the I/O
// workloads, with one and two rings.
func NullSuite(out io.Writer, depth int, queueSize uint16, warmup, dur time.Duration) error {
	fmt.Fprintf(out, "Front end alone: an in-process null device answers at once without touching data (its own CPU is\nincluded in the front-end CPU figure), depth %d, %v per run\n\n", depth, dur)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workload\trings\treq/s\tequiv.\tfront-end CPUs\tµs CPU/req\tkicks/req\tsleeps/req\t")
	var mu sync.Mutex
	for _, w := range DefaultWorkloads() {
		if !w.IsIO() {
			continue
		}
		for _, nr := range []int{1, 2} {
			t, stop, err := NullTarget(nr, queueSize, bufMiB(depth, w.Size))
			if err != nil {
				return err
			}
			res, err := Run(t, RunSpec{Workload: w, Depth: depth, Warmup: warmup, Duration: dur})
			stop()
			if err != nil {
				return err
			}
			mu.Lock()
			s := res.Elapsed.Seconds()
			all := float64(res.Ops) // measured window only
			fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%.2f\t%.2f\t%.3f\t%.3f\t\n", w.Name, nr, all/s, fmtRate(res.Rate(w), w.Unit()),
				res.FrontCPU.Seconds()/s, res.FrontCPU.Seconds()*1e6/all,
				float64(res.Kicks)/float64(res.AllOps), float64(res.Sleeps)/float64(res.AllOps))
			mu.Unlock()
		}
	}
	tw.Flush()
	return nil
}
