package bench

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// Kind is a workload's request pattern.
type Kind int

const (
	SeqWrite  Kind = iota // WRITE of Size bytes, sequential per file, files round-robin
	SeqRead               // READ likewise
	RandWrite             // WRITE of Size bytes at a random aligned offset of a random file
	RandRead              // READ likewise
	Meta                  // CREATE, GETATTR, RELEASE, UNLINK (+ FORGET on hiprio) cycles
)

// Workload is one measured request pattern.
type Workload struct {
	Name  string
	Kind  Kind
	Size  int // bytes per READ/WRITE
	Files int // data files used (round-robin or random)
	// Depth, if set, is the workload's own number of requests in
	// flight, instead of the suite's (SuiteOptions.Depth): the depth-1
	// rows measure one request at a time, as a shell or a build waits.
	Depth int
}

// IsIO reports whether the workload moves data.
func (w Workload) IsIO() bool { return w.Kind != Meta }

// Unit names the throughput figure.
func (w Workload) Unit() string {
	switch {
	case w.Kind == Meta:
		return "ops/s"
	case w.Size >= 64<<10:
		return "MB/s"
	}
	return "IOPS"
}

// FileRef is an open data file: its node id and file handle.
type FileRef struct{ NodeID, FH uint64 }

// Target is a connected, initialised device with request rings taken over
// by Rings.
type Target struct {
	Dev       *vmm.Device // nil for the null device
	Mem       *vmm.Memory
	BufRegion int
	Hiprio    *Ring
	Rings     []*Ring // request rings
	Files     []FileRef
	FileSize  uint64
	Init      *vmm.InitOut
	// DeviceDiag, if set, describes the device side of the rings for a
	// stalled run's error (the null device's own counters).
	DeviceDiag func() string
	null       []*nullDevice // NullTarget's devices, ring by ring
}

// Close disconnects (the daemon then exits) and closes the rings' fds.
func (t *Target) Close() {
	if t.Dev != nil {
		t.Dev.Close()
	}
	for _, r := range append([]*Ring{t.Hiprio}, t.Rings...) {
		if r != nil {
			r.Close()
		}
	}
}

// TargetOptions are the device options for nrings request rings of
// queueSize descriptors, with room for bufMiB of request buffers.
func TargetOptions(nrings int, queueSize uint16, bufMiB uint64) vmm.Options {
	o := vmm.DefaultOptions()
	o.Queues = 1 + nrings
	o.QueueSize = queueSize
	o.Layout = vmm.SplitLayout(16*vmm.MiB, bufMiB*vmm.MiB)
	o.Timeout = 10 * time.Second
	return o
}

// Connect starts the device on sock (retrying while the daemon creates
// its socket), sends INIT, looks up and opens the data files on ring 1,
// then takes over every ring.
func Connect(sock string, opts vmm.Options, files []string, fileSize uint64) (*Target, error) {
	var dev *vmm.Device
	var err error
	deadline := time.Now().Add(10 * time.Second)
	for {
		dev, err = vmm.Start(sock, opts)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		return nil, fmt.Errorf("connect %s: %w", sock, err)
	}
	t := &Target{Dev: dev, Mem: dev.Mem, BufRegion: opts.BufRegion, FileSize: fileSize}
	s := vmm.NewSession(dev, 1)
	if t.Init, err = s.Init(vmm.KernelMinor, vmm.LinuxInitFlags); err != nil {
		t.Close()
		return nil, fmt.Errorf("INIT: %w", err)
	}
	for _, name := range files {
		e, err := s.Lookup(vmm.RootID, name)
		if err != nil {
			t.Close()
			return nil, fmt.Errorf("LOOKUP %s: %w", name, err)
		}
		fh, err := s.Open(e.NodeID, 2 /* O_RDWR */)
		if err != nil {
			t.Close()
			return nil, fmt.Errorf("OPEN %s: %w", name, err)
		}
		t.Files = append(t.Files, FileRef{e.NodeID, fh})
	}
	rings, err := TakeoverAll(dev)
	if err != nil {
		t.Close()
		return nil, err
	}
	t.Hiprio, t.Rings = rings[0], rings[1:]
	return t, nil
}

// Result is one measured run.
type Result struct {
	Ops      uint64 // completed in the measurement window
	AllOps   uint64 // completed in the whole run (warm-up and drain too)
	Bytes    uint64
	Elapsed  time.Duration
	Lat      hist
	Kicks    uint64
	Sleeps   uint64
	Spins    uint64
	Wakeups  uint64
	Withheld uint64        // stalls ≥ 0.5 s: awaited elements used, no notification sent
	Starved  uint64        // stalls ≥ 0.5 s: notification pending, front end not scheduled
	OtherCPU time.Duration // CPU time of everything else on the machine (from /proc/stat)
	FrontCPU time.Duration // user+sys of this process during the measurement
}

// Rate is ops or bytes per second, per the workload's unit (MB = 10^6 B).
func (r *Result) Rate(w Workload) float64 {
	s := r.Elapsed.Seconds()
	if s == 0 {
		return 0
	}
	if w.Unit() == "MB/s" {
		return float64(r.Bytes) / s / 1e6
	}
	return float64(r.Ops) / s
}

// ---- guest buffers ----

type allocator struct {
	mem    *vmm.Memory
	region int
	packed bool     // tables of packed descriptors
	pages  []uint64 // shuffled free pages
}

func (a *allocator) buf(n, align uint64) (uint64, []byte, error) {
	gpa, err := a.mem.AllocIn(a.region, n, align)
	if err != nil {
		return 0, nil, err
	}
	h, err := a.mem.Slice(gpa, n)
	return gpa, h, err
}

// reservePages sets aside n guest pages, handed out in shuffled order so
// that consecutive data segments are not adjacent in guest memory (as page
// cache pages are not): a back end cannot coalesce them.
func (a *allocator) reservePages(n int, fill bool) error {
	if n == 0 {
		return nil
	}
	gpa, h, err := a.buf(uint64(n)*vmm.PageSize, vmm.PageSize)
	if err != nil {
		return err
	}
	if fill {
		for i := range h {
			h[i] = byte(i*7 + i>>12)
		}
	}
	a.pages = a.pages[:0]
	for i := range n {
		a.pages = append(a.pages, gpa+uint64(i)*vmm.PageSize)
	}
	r := rand.New(rand.NewPCG(1, 2))
	r.Shuffle(len(a.pages), func(i, j int) { a.pages[i], a.pages[j] = a.pages[j], a.pages[i] })
	return nil
}

func (a *allocator) page() uint64 {
	p := a.pages[len(a.pages)-1]
	a.pages = a.pages[:len(a.pages)-1]
	return p
}

// table writes segs as an indirect descriptor table and returns the head
// descriptor that points at it.
func (a *allocator) table(segs []vmm.Segment) (vmm.Desc, error) {
	if a.packed {
		return a.packedTable(segs)
	}
	ds := make([]vmm.Desc, len(segs))
	for i, s := range segs {
		ds[i] = vmm.Desc{Addr: s.Addr, Len: s.Len}
		if s.Write {
			ds[i].Flags |= vmm.DescWrite
		}
		if i+1 < len(segs) {
			ds[i].Flags |= vmm.DescNext
			ds[i].Next = uint16(i + 1)
		}
	}
	return a.writeTable(vmm.EncodeDescs(ds))
}

// writeTable places an encoded descriptor table in guest memory and
// returns the indirect descriptor that points at it.
func (a *allocator) writeTable(table []byte) (vmm.Desc, error) {
	gpa, _, err := a.buf(uint64(len(table)), vmm.DescSize)
	if err != nil {
		return vmm.Desc{}, err
	}
	if err := a.mem.WriteAt(table, gpa); err != nil {
		return vmm.Desc{}, err
	}
	return vmm.Desc{Addr: gpa, Len: uint32(len(table)), Flags: vmm.DescIndirect}, nil
}

// packedTable is table for a packed ring: consecutive packed descriptors,
// no NEXT.
func (a *allocator) packedTable(segs []vmm.Segment) (vmm.Desc, error) {
	ds := make([]vmm.PackedDesc, len(segs))
	for i, s := range segs {
		ds[i] = vmm.PackedDesc{Addr: s.Addr, Len: s.Len}
		if s.Write {
			ds[i].Flags |= vmm.DescWrite
		}
	}
	return a.writeTable(vmm.EncodePackedDescs(ds))
}

// ---- request slots ----

// Metadata cycle steps.
const (
	stepCreate = iota
	stepGetattr
	stepRelease
	stepUnlink
	nSteps
)

// slot is one request in flight at a time, laid out once in guest memory
// as Linux's virtio_fs lays it out (in header, in args, in pages | out
// header, out args, out pages; one indirect descriptor) and reused.
type slot struct {
	id     uint16
	hdr    []byte // fuse_in_header
	args   []byte // READ/WRITE: fuse_read_in/fuse_write_in
	outHdr []byte
	out    []byte // reply arguments (WRITE: fuse_write_out; CREATE/GETATTR)
	start  time.Duration
	unique uint64
	want   uint32 // expected used length

	// Meta: one table and argument buffer per step.
	heads  [nSteps]vmm.Desc
	margs  [nSteps][]byte
	step   int
	nodeid uint64
	fh     uint64
}

func putInHeader(b []byte, length, op uint32, nodeid uint64) {
	le.PutUint32(b[0:], length)
	le.PutUint32(b[4:], op)
	le.PutUint64(b[16:], nodeid)
	// uid, gid, pid, total_extlen, padding: 0
}

// newIOSlot lays out a READ or WRITE of size bytes.
func newIOSlot(a *allocator, id uint16, write bool, size int) (*slot, vmm.Desc, error) {
	s := &slot{id: id}
	var segs []vmm.Segment
	var gpa uint64
	var err error
	add := func(n uint64, w bool) []byte {
		if err != nil {
			return nil
		}
		var h []byte
		gpa, h, err = a.buf(n, 8)
		segs = append(segs, vmm.Segment{Addr: gpa, Len: uint32(n), Write: w})
		return h
	}
	pages := func(w bool) {
		for done := 0; done < size; done += vmm.PageSize {
			segs = append(segs, vmm.Segment{Addr: a.page(), Len: uint32(min(vmm.PageSize, size-done)), Write: w})
		}
	}
	s.hdr = add(vmm.FuseInHeaderSize, false)
	s.args = add(40, false)
	if write {
		pages(false)
	}
	s.outHdr = add(vmm.FuseOutHeaderSize, true)
	if write {
		s.out = add(8, true)
		s.want = vmm.FuseOutHeaderSize + 8
	} else {
		pages(true)
		s.want = vmm.FuseOutHeaderSize + uint32(size)
	}
	if err != nil {
		return nil, vmm.Desc{}, err
	}
	op, inLen := uint32(vmm.OpRead), uint32(vmm.FuseInHeaderSize+40)
	if write {
		op, inLen = vmm.OpWrite, inLen+uint32(size)
	}
	putInHeader(s.hdr, inLen, op, 0)
	copy(s.args, vmm.ReadWriteIn(0, 0, uint32(size), 0))
	le.PutUint32(s.args[32:], 2) // fuse_read_in/fuse_write_in.flags: the file's O_RDWR
	head, err := a.table(segs)
	return s, head, err
}

// newMetaSlot lays out the four requests of a metadata cycle on file name.
func newMetaSlot(a *allocator, id uint16, name string) (*slot, error) {
	s := &slot{id: id}
	var err error
	buf := func(n uint64) (uint64, []byte) {
		if err != nil {
			return 0, nil
		}
		g, h, e := a.buf(n, 8)
		err = e
		return g, h
	}
	hdrGPA, hdr := buf(vmm.FuseInHeaderSize)
	outGPA, outHdr := buf(vmm.FuseOutHeaderSize)
	replyGPA, reply := buf(vmm.FuseEntryOutSize + 16) // fuse_entry_out + fuse_open_out
	if err != nil {
		return nil, err
	}
	s.hdr, s.outHdr, s.out = hdr, outHdr, reply
	zname := append([]byte(name), 0)
	argLen := [nSteps]int{16 + len(zname), 16, 24, len(zname)}
	replyLen := [nSteps]int{vmm.FuseEntryOutSize + 16, vmm.FuseAttrOutSize, 0, 0}
	for step := range nSteps {
		g, h := buf(uint64(argLen[step]))
		if err != nil {
			return nil, err
		}
		s.margs[step] = h
		segs := []vmm.Segment{{Addr: hdrGPA, Len: vmm.FuseInHeaderSize}, {Addr: g, Len: uint32(argLen[step])},
			{Addr: outGPA, Len: vmm.FuseOutHeaderSize, Write: true}}
		if replyLen[step] > 0 {
			segs = append(segs, vmm.Segment{Addr: replyGPA, Len: uint32(replyLen[step]), Write: true})
		}
		if s.heads[step], err = a.table(segs); err != nil {
			return nil, err
		}
	}
	c := s.margs[stepCreate]
	le.PutUint32(c[0:], 0o2|0o100|0o200) // O_RDWR|O_CREAT|O_EXCL
	le.PutUint32(c[4:], 0o100644)
	le.PutUint32(c[8:], 0o022)
	copy(c[16:], zname)
	copy(s.margs[stepUnlink], zname)
	le.PutUint32(s.margs[stepGetattr][0:], 1) // FUSE_GETATTR_FH
	le.PutUint32(s.margs[stepRelease][8:], 2) // release flags: O_RDWR
	return s, nil
}

// ---- the run ----

const (
	phaseWarmup = iota
	phaseMeasure
	phaseStop
)

type runState struct {
	w        Workload
	files    []FileRef
	fileSize uint64
	seq      []atomic.Uint64 // next sequential offset per file
	phase    atomic.Int32
	base     time.Time
	hiprio   *hiprio
	irqDiv   int
}

func (rs *runState) now() time.Duration { return time.Since(rs.base) }

type worker struct {
	rs       *runState
	ring     *Ring
	slots    []*slot
	inflight int
	rng      uint64
	rr       int
	rrStep   int // rings that share the files: ring i carries files i, i+rrStep, ...
	home     int // this ring's first file
	unique   uint64
	lat      hist
	ops      uint64
	allOps   uint64
	bytes    uint64
	err      error
}

func (w *worker) rand() uint64 {
	// xorshift64*
	w.rng ^= w.rng >> 12
	w.rng ^= w.rng << 25
	w.rng ^= w.rng >> 27
	return w.rng * 2685821657736338717
}

func (w *worker) nextUnique() uint64 {
	w.unique += 2
	return w.unique
}

// submit fills slot s for its next request and adds it to the ring.
func (w *worker) submit(s *slot) {
	rs := w.rs
	s.unique = w.nextUnique()
	le.PutUint64(s.hdr[8:], s.unique)
	switch rs.w.Kind {
	case Meta:
		w.submitMeta(s)
	default:
		var f int
		var off uint64
		size := uint64(rs.w.Size)
		switch rs.w.Kind {
		case SeqWrite, SeqRead:
			f = w.rr % len(rs.files)
			w.rr += w.rrStep
			off = (rs.seq[f].Add(size) - size) % (rs.fileSize / size * size)
		default:
			r := w.rand()
			f = w.home + int(r>>48)%(len(rs.files)/w.rrStep)*w.rrStep
			off = (r & (1<<40 - 1)) % (rs.fileSize / size) * size
		}
		le.PutUint64(s.hdr[16:], rs.files[f].NodeID)
		le.PutUint64(s.args[0:], rs.files[f].FH)
		le.PutUint64(s.args[8:], off)
	}
	s.start = rs.now()
	w.ring.Add(s.id)
	w.inflight++
}

func (w *worker) submitMeta(s *slot) {
	var op uint32
	nodeid := uint64(vmm.RootID)
	args := s.margs[s.step]
	var reply uint32
	switch s.step {
	case stepCreate:
		op, reply = vmm.OpCreate, vmm.FuseEntryOutSize+16
	case stepGetattr:
		op, nodeid, reply = vmm.OpGetattr, s.nodeid, vmm.FuseAttrOutSize
		le.PutUint64(args[8:], s.fh)
	case stepRelease:
		op, nodeid = vmm.OpRelease, s.nodeid
		le.PutUint64(args[0:], s.fh)
	case stepUnlink:
		op = vmm.OpUnlink
	}
	putInHeader(s.hdr, uint32(vmm.FuseInHeaderSize+len(args)), op, nodeid)
	s.want = vmm.FuseOutHeaderSize + reply
	w.ring.SetDesc(s.id, s.heads[s.step])
}

// complete checks slot s's reply of n bytes; it reports whether the slot
// should be resubmitted.
func (w *worker) complete(s *slot, n uint32, now time.Duration) bool {
	w.inflight--
	w.allOps++
	rs := w.rs
	if n != s.want || le.Uint64(s.outHdr[8:]) != s.unique || le.Uint32(s.outHdr[4:]) != 0 {
		w.fail(s, n)
		return false
	}
	measuring := rs.phase.Load() == phaseMeasure
	if measuring {
		w.lat.add(int64(now - s.start))
		w.ops++
	}
	switch rs.w.Kind {
	case Meta:
		switch s.step {
		case stepCreate:
			s.nodeid = le.Uint64(s.out[0:])
			s.fh = le.Uint64(s.out[vmm.FuseEntryOutSize:])
		case stepUnlink:
			if err := rs.hiprio.forget(s.nodeid); err != nil {
				w.err = err
				return false
			}
		}
		s.step = (s.step + 1) % nSteps
		// Finish a started cycle even when stopping: no file is left.
		return s.step != stepCreate || rs.phase.Load() != phaseStop
	case SeqWrite, RandWrite:
		if got := le.Uint32(s.out); got != uint32(rs.w.Size) {
			w.err = fmt.Errorf("WRITE of %d bytes wrote %d", rs.w.Size, got)
			return false
		}
	}
	if measuring {
		w.bytes += uint64(rs.w.Size)
	}
	return rs.phase.Load() != phaseStop
}

func (w *worker) fail(s *slot, n uint32) {
	e := int32(le.Uint32(s.outHdr[4:]))
	w.err = fmt.Errorf("ring %d slot %d (step %d): used len %d (want %d), reply unique %d (want %d), error %d",
		w.ring.Index, s.id, s.step, n, s.want, le.Uint64(s.outHdr[8:]), s.unique, e)
}

// loop keeps every slot in flight until the run stops, then drains. It
// keeps its OS thread, as a vCPU would.
func (w *worker) loop() {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	w.ring.tid.Store(int32(unix.Gettid()))
	for _, s := range w.slots {
		w.submit(s)
	}
	if w.err = w.ring.Publish(); w.err != nil {
		return
	}
	for w.inflight > 0 {
		batch := 1
		if w.rs.irqDiv > 0 {
			batch = max(1, w.inflight/w.rs.irqDiv)
		}
		if err := w.ring.Wait(batch); err != nil {
			w.err = err
			return
		}
		now := w.rs.now()
		for {
			id, n, ok := w.ring.Next()
			if !ok {
				break
			}
			if int(id) >= len(w.slots) {
				w.err = fmt.Errorf("ring %d: device returned unknown id %d", w.ring.Index, id)
				return
			}
			s := w.slots[id]
			if w.complete(s, n, now) {
				w.submit(s)
			}
			if w.err != nil {
				return
			}
		}
		if w.err = w.ring.Publish(); w.err != nil {
			return
		}
	}
}

// ---- hiprio FORGETs ----

// hiprio sends FORGETs on ring 0 as Linux does: one 48-byte readable
// buffer (header and fuse_forget_in), no reply, one kick decision each.
type hiprio struct {
	mu     sync.Mutex
	ring   *Ring
	bufs   [][]byte
	free   []uint16
	unique uint64
	sent   uint64
}

func newHiprio(a *allocator, r *Ring, n int) (*hiprio, error) {
	h := &hiprio{ring: r, unique: 1 << 62}
	n = min(n, int(r.Size()))
	for i := range n {
		gpa, b, err := a.buf(48, 8)
		if err != nil {
			return nil, err
		}
		r.SetDesc(uint16(i), vmm.Desc{Addr: gpa, Len: 48})
		putInHeader(b, 48, vmm.OpForget, 0)
		le.PutUint64(b[40:], 1) // nlookup
		h.bufs = append(h.bufs, b)
		h.free = append(h.free, uint16(i))
	}
	return h, nil
}

func (h *hiprio) reap() {
	for {
		id, _, ok := h.ring.Next()
		if !ok {
			return
		}
		h.free = append(h.free, uint16(id))
	}
}

func (h *hiprio) forget(nodeid uint64) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.reap()
	for len(h.free) == 0 {
		if err := h.ring.Wait(1); err != nil {
			return err
		}
		h.reap()
	}
	id := h.free[len(h.free)-1]
	h.free = h.free[:len(h.free)-1]
	b := h.bufs[id]
	h.unique += 2
	le.PutUint64(b[8:], h.unique)
	le.PutUint64(b[16:], nodeid)
	h.ring.Add(id)
	h.sent++
	return h.ring.Publish()
}

// drain waits until the device has returned every FORGET.
func (h *hiprio) drain(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	h.mu.Lock()
	defer h.mu.Unlock()
	for {
		h.reap()
		if len(h.free) == len(h.bufs) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("hiprio: %d FORGETs not returned", len(h.bufs)-len(h.free))
		}
		time.Sleep(time.Millisecond)
	}
}

// ---- Run ----

// RunSpec is one measurement.
type RunSpec struct {
	Workload Workload
	Depth    int // requests in flight in total, spread over the target's rings
	Warmup   time.Duration
	Duration time.Duration
	Prefix   string // names of metadata files
	// Spin is how long a ring's goroutine polls the used ring before it
	// sleeps on the call eventfd; IrqDiv > 0 asks for an interrupt only
	// once inflight/IrqDiv requests have completed (0: at the next one,
	// as Linux's virtio_fs does).
	Spin   time.Duration
	IrqDiv int
	Raw    bool
	// Interleave sends every ring's requests to every file: sequential
	// ones to each file in turn, random ones to a random file. By
	// default, with as many files as a multiple of the rings, ring i
	// carries files i, i+rings, ... only, sequential or random: Linux
	// maps a request to its submitting CPU's queue, so a fio job writing
	// its own file stays on one queue, and one file written through
	// several queues at once is the exception.
	Interleave bool
	// Hooks run at the start and end of the measurement window (for
	// daemon CPU and profiles).
	OnStart, OnStop func()
	// DebugPids lists the daemon's processes for BENCH_DEBUG output.
	DebugPids func() []int
	// StuckAfter is how long requests may stay in flight after the run
	// stopped before it is reported stuck (0: 15 s).
	StuckAfter time.Duration
}

// Run drives t with spec and returns the measurement.
func Run(t *Target, spec RunSpec) (*Result, error) {
	w := spec.Workload
	nr := len(t.Rings)
	if spec.Depth < nr {
		return nil, fmt.Errorf("depth %d < %d rings", spec.Depth, nr)
	}
	if w.IsIO() {
		if int(t.Init.MaxWrite) < w.Size && w.Kind != SeqRead && w.Kind != RandRead {
			return nil, fmt.Errorf("daemon's max_write %d < %d", t.Init.MaxWrite, w.Size)
		}
		if len(t.Files) < w.Files {
			return nil, fmt.Errorf("%d files open, workload needs %d", len(t.Files), w.Files)
		}
	}
	rs := &runState{w: w, files: t.Files[:min(w.Files, len(t.Files))], fileSize: t.FileSize,
		base: time.Now(), irqDiv: spec.IrqDiv}
	rs.seq = make([]atomic.Uint64, len(rs.files))
	a := &allocator{mem: t.Mem, region: t.BufRegion, packed: t.Rings[0].packed != nil}
	pagesPer := (w.Size + vmm.PageSize - 1) / vmm.PageSize
	if w.IsIO() {
		if err := a.reservePages(spec.Depth*pagesPer, w.Kind == SeqWrite || w.Kind == RandWrite); err != nil {
			return nil, err
		}
	} else {
		h, err := newHiprio(a, t.Hiprio, 4*spec.Depth)
		if err != nil {
			return nil, err
		}
		rs.hiprio = h
	}
	workers := make([]*worker, nr)
	for i, r := range t.Rings {
		r.Spin, r.Raw = spec.Spin, spec.Raw
		wk := &worker{rs: rs, ring: r, rng: uint64(i)*0x9e3779b97f4a7c15 + 88172645463325252,
			unique: uint64(i+1) << 48, rr: i, rrStep: 1}
		if !spec.Interleave && len(rs.files)%nr == 0 {
			wk.rrStep, wk.home = nr, i
		}
		n := spec.Depth / nr
		if i < spec.Depth%nr {
			n++
		}
		if n > int(r.Size()) {
			return nil, fmt.Errorf("depth %d exceeds ring size %d", n, r.Size())
		}
		for j := range n {
			var s *slot
			var err error
			if w.IsIO() {
				var head vmm.Desc
				s, head, err = newIOSlot(a, uint16(j), w.Kind == SeqWrite || w.Kind == RandWrite, w.Size)
				if err == nil {
					r.SetDesc(uint16(j), head)
				}
			} else {
				s, err = newMetaSlot(a, uint16(j), fmt.Sprintf("%s-%d-%d", spec.Prefix, i, j))
			}
			if err != nil {
				return nil, err
			}
			wk.slots = append(wk.slots, s)
		}
		workers[i] = wk
	}

	var wg sync.WaitGroup
	for _, wk := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wk.loop()
			if wk.err != nil {
				// Stop the others too.
				rs.phase.Store(phaseStop)
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	// Watchdog: a ring asleep for half a second, in one sleep, although
	// the elements it waits for are in the used ring is a stall. If the call eventfd is
	// not readable and the thread still waits in read(2), the device
	// withheld the notification (a device that lost it for good hangs the
	// run: the 15 s limit below reports it); if the eventfd is readable,
	// the front end was not scheduled (a loaded machine). Neither is
	// papered over: the watchdog only counts.
	watchdog := make(chan struct{})
	defer func() { <-watchdog }() // it reads the rings' fds, which the caller closes
	go func() {
		defer close(watchdog)
		all := append([]*Ring{t.Hiprio}, t.Rings...)
		suspect := make([]int, len(all))
		sleeps := make([]uint64, len(all))
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			for i, r := range all {
				if r == nil {
					continue
				}
				sleep, lost := r.checkLost()
				if !lost || sleep != sleeps[i] {
					suspect[i] = 0
				}
				sleeps[i] = sleep
				if !lost {
					continue
				}
				if suspect[i]++; suspect[i] != 5 {
					continue
				}
				p := []unix.PollFd{{Fd: int32(r.call), Events: unix.POLLIN}}
				unix.Poll(p, 0)
				wchan, _ := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/wchan", r.tid.Load()))
				withheld := p[0].Revents == 0 && string(wchan) == "do_wait_intr_irq"
				if withheld {
					r.Withheld.Add(1)
				} else {
					r.Starved.Add(1)
				}
				if os.Getenv("BENCH_DEBUG") != "" {
					fmt.Fprintf(os.Stderr, "stall at %v phase %d: call fd readable %v, waiting in %q: %s\n",
						rs.now(), rs.phase.Load(), p[0].Revents != 0, wchan, r.Diag())
					if spec.DebugPids != nil {
						fmt.Fprintf(os.Stderr, "  daemon threads: %s\n", threadStates(spec.DebugPids()))
					}
				}
			}
		}
	}()
	sleep := func(d time.Duration) bool {
		select {
		case <-done:
			return false
		case <-time.After(d):
			return true
		}
	}
	res := &Result{}
	ok := sleep(spec.Warmup)
	var ru0, ru1 time.Duration
	var t0, t1 time.Time
	if ok {
		if spec.OnStart != nil {
			spec.OnStart()
		}
		ru0 = selfCPU()
		sys0 := systemCPU()
		t0 = time.Now()
		rs.phase.Store(phaseMeasure)
		ok = sleep(spec.Duration)
		rs.phase.Store(phaseStop)
		t1 = time.Now()
		ru1 = selfCPU()
		res.OtherCPU = systemCPU() - sys0 - (ru1 - ru0) // the daemon's share is subtracted by the caller
		if spec.OnStop != nil {
			spec.OnStop()
		}
	}
	rs.phase.Store(phaseStop)
	stuck := spec.StuckAfter
	if stuck == 0 {
		stuck = 15 * time.Second
	}
	select {
	case <-done:
	case <-time.After(stuck):
		// Say which side lost track: read the rings as they are, then
		// kick every ring once and see whether that unsticks them.
		var diag []string
		for _, r := range t.Rings {
			diag = append(diag, r.Diag())
		}
		if t.DeviceDiag != nil {
			diag = append(diag, t.DeviceDiag())
		}
		for _, r := range t.Rings {
			r.kick()
		}
		select {
		case <-done:
			return nil, fmt.Errorf("requests stuck until an extra kick (a lost kick?): %s", strings.Join(diag, "; "))
		case <-time.After(min(stuck, 2*time.Second)):
		}
		for _, r := range append([]*Ring{t.Hiprio}, t.Rings...) {
			if r != nil { // a null target has no hiprio ring
				r.Interrupt()
			}
		}
		<-done
		for _, r := range t.Rings {
			diag = append(diag, r.Counters())
		}
		return nil, fmt.Errorf("requests not completed %v after the run stopped, nor after an extra kick: %s", stuck, strings.Join(diag, "; "))
	}
	var errs []error
	for _, wk := range workers {
		if wk.err != nil {
			errs = append(errs, wk.err)
		}
		res.Ops += wk.ops
		res.AllOps += wk.allOps
		res.Bytes += wk.bytes
		res.Lat.merge(&wk.lat)
		res.Kicks += wk.ring.Kicks
		res.Sleeps += wk.ring.Sleeps
		res.Spins += wk.ring.Spins
		res.Withheld += wk.ring.Withheld.Load()
		res.Starved += wk.ring.Starved.Load()
		res.Wakeups += wk.ring.Wakeups
	}
	if rs.hiprio != nil {
		if err := rs.hiprio.drain(5 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if !ok {
		return nil, errors.New("run ended early")
	}
	res.Elapsed = t1.Sub(t0)
	res.FrontCPU = ru1 - ru0
	return res, nil
}

// threadStates lists state and wait channel of every thread of pids.
func threadStates(pids []int) string {
	var out []string
	for _, pid := range pids {
		ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		for _, e := range ents {
			st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, e.Name()))
			wchan, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/wchan", pid, e.Name()))
			if f := statFields(st); len(f) > 0 {
				out = append(out, fmt.Sprintf("%s:%s/%s", e.Name(), f[0], wchan))
			}
		}
	}
	return strings.Join(out, " ")
}
