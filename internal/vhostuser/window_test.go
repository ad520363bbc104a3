package vhostuser

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

const testWindow = 8 << 20

// Window test requests: a 48-byte readable buffer {u32 op, u32 writable,
// u64 fdOffset, winOffset, length, u32 file}; the reply is a 16-byte
// status {u32 errno} in the first writable buffer, then any data.
const (
	opMap      = 1
	opUnmap    = 2
	opUnmapAll = 3
	opFill     = 4 // Go-copy a pattern into the data buffers
	opReadFile = 5 // preadv the data file into the data buffers
	opHoldFill = 6 // opFill once the test releases hold
)

type winReq struct {
	op, file                    uint32
	writable                    bool
	fdOffset, winOffset, length uint64
}

func (r winReq) bytes() []byte {
	b := make([]byte, 48)
	binary.LittleEndian.PutUint32(b[0:], r.op)
	if r.writable {
		b[4] = 1
	}
	binary.LittleEndian.PutUint64(b[8:], r.fdOffset)
	binary.LittleEndian.PutUint64(b[16:], r.winOffset)
	binary.LittleEndian.PutUint64(b[24:], r.length)
	binary.LittleEndian.PutUint32(b[32:], r.file)
	return b
}

// winBackend is a back end with a window whose handler drives it.
type winBackend struct {
	b       *Backend
	files   []*os.File
	hold    chan struct{} // opHoldFill waits for it
	holding chan struct{} // opHoldFill says it holds the chain
	logs    *syncBuffer
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type winQueue struct{ w *winBackend }

func (q winQueue) Serve(in, out *bufvec.Vec) uint32 {
	var b [48]byte
	if in.ReadFull(b[:]) != nil {
		return 0
	}
	r := winReq{op: binary.LittleEndian.Uint32(b[0:]), writable: b[4] != 0,
		fdOffset: binary.LittleEndian.Uint64(b[8:]), winOffset: binary.LittleEndian.Uint64(b[16:]),
		length: binary.LittleEndian.Uint64(b[24:]), file: binary.LittleEndian.Uint32(b[32:])}
	win := q.w.b.Window()
	var err error
	switch r.op {
	case opMap:
		err = win.Map(int(q.w.files[r.file].Fd()), r.fdOffset, r.winOffset, r.length, r.writable)
	case opUnmap:
		err = win.Unmap(r.winOffset, r.length)
	case opUnmapAll:
		win.UnmapAll()
	case opHoldFill:
		q.w.holding <- struct{}{}
		<-q.w.hold
		fallthrough
	case opFill:
		if err = out.Skip(16); err == nil {
			p := bytes.Repeat([]byte{byte(r.fdOffset)}, out.Len())
			err = out.WriteFull(p)
		}
	case opReadFile:
		if err = out.Skip(16); err == nil {
			_, err = out.ReadFrom(int(q.w.files[r.file].Fd()), int64(r.fdOffset), out.Len(), bufvec.Bounded)
		}
	}
	var st [16]byte
	var errno unix.Errno
	if err != nil && !errors.As(err, &errno) {
		errno = unix.EPROTO
	}
	binary.LittleEndian.PutUint32(st[:], uint32(errno))
	if out.WriteAt(st[:], 0) != nil {
		return 0
	}
	return uint32(out.Size())
}

// startWindow serves a back end with a testWindow window and two request
// rings and returns it with a front end that acked SHMEM, started, whose
// back-end channel is served by serve (nil: none).
func startWindow(t *testing.T, serve func(d *vmm.Device) vmm.BackendHandler) (*winBackend, *vmm.Device) {
	t.Helper()
	return startWindowWait(t, serve, mapReplyWait)
}

// startWindowWait is startWindow with wait as the bound on a map's answer.
func startWindowWait(t *testing.T, serve func(d *vmm.Device) vmm.BackendHandler, wait time.Duration) (*winBackend, *vmm.Device) {
	t.Helper()
	regionWait := mapRegionWait
	if serve == nil {
		// A VMM played by the test answers maps without memory regions.
		regionWait = 50 * time.Millisecond
	}
	return startWindowRegion(t, serve, wait, regionWait)
}

// startWindowRegion is startWindowWait with regionWait as the bound on the
// wait for a mapping's memory region.
func startWindowRegion(t *testing.T, serve func(d *vmm.Device) vmm.BackendHandler, wait, regionWait time.Duration) (*winBackend, *vmm.Device) {
	t.Helper()
	w := &winBackend{hold: make(chan struct{}), holding: make(chan struct{}, 1), logs: &syncBuffer{}}
	for i := range 2 {
		f, err := os.Create(filepath.Join(t.TempDir(), "data"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		data := make([]byte, 4<<20)
		for j := range data {
			data[j] = byte(j/4096 + 16*i)
		}
		if _, err := f.Write(data); err != nil {
			t.Fatal(err)
		}
		w.files = append(w.files, f)
	}
	b, err := NewBackend(Config{RequestQueues: 2, Tag: "win", CacheSize: testWindow, State: &fakeState{},
		Logger:  slog.New(slog.NewTextHandler(w.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Handler: HandlerFunc(func(int) RequestHandler { return winQueue{w} })})
	if err != nil {
		t.Fatal(err)
	}
	w.b = b
	b.window.wait, b.window.regionWait = wait, regionWait
	opts := vmm.DefaultOptions()
	opts.Queues = 3
	opts.Shmem = true
	d := serveOne(t, b, func(sock string) (*vmm.Device, error) { return vmm.Start(sock, opts) })
	if d.Window == nil || d.Window.Size != testWindow || d.ShmemRegions != 1 {
		t.Fatalf("window %+v, %d regions: want one of %d bytes", d.Window, d.ShmemRegions, testWindow)
	}
	if serve != nil {
		d.ServeBackend(serve(d))
	}
	return w, d
}

// winCall submits r on ring with a 16-byte status buffer and the writable
// data segments extra, and returns the errno.
func winCall(t *testing.T, d *vmm.Device, ring int, r winReq, extra ...vmm.Segment) unix.Errno {
	t.Helper()
	c, st := winSubmit(t, d, ring, r, extra...)
	if _, err := c.Wait(10 * time.Second); err != nil {
		t.Fatalf("request %+v: %v", r, err)
	}
	return winStatus(t, d, st)
}

func winSubmit(t *testing.T, d *vmm.Device, ring int, r winReq, extra ...vmm.Segment) (*vmm.Chain, uint64) {
	t.Helper()
	in, err := d.Mem.Alloc(48, 8)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Mem.WriteAt(r.bytes(), in); err != nil {
		t.Fatal(err)
	}
	st, err := d.Mem.Alloc(16, 8)
	if err != nil {
		t.Fatal(err)
	}
	segs := append([]vmm.Segment{{Addr: in, Len: 48}, {Addr: st, Len: 16, Write: true}}, extra...)
	c, err := d.Queue(ring).Submit(segs, vmm.IndirectNever)
	if err != nil {
		t.Fatal(err)
	}
	return c, st
}

func winStatus(t *testing.T, d *vmm.Device, st uint64) unix.Errno {
	t.Helper()
	var b [4]byte
	if err := d.Mem.ReadAt(b[:], st); err != nil {
		t.Fatal(err)
	}
	return unix.Errno(binary.LittleEndian.Uint32(b[:]))
}

func mapReq(file uint32, fdOffset, winOffset, length uint64) winReq {
	return winReq{op: opMap, file: file, writable: true, fdOffset: fdOffset, winOffset: winOffset, length: length}
}

func vmmMappings(d *vmm.Device) [][2]uint64 {
	var out [][2]uint64
	for _, m := range d.Window.Mappings() {
		out = append(out, [2]uint64{m.ShmOffset, m.Len})
	}
	return out
}

func sameMappings(a, b [][2]uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// checkMappings compares the back end's records and the VMM's mappings
// with want.
func checkMappings(t *testing.T, w *winBackend, d *vmm.Device, want [][2]uint64) {
	t.Helper()
	if got := w.b.Window().Mappings(); !sameMappings(got, want) {
		t.Errorf("back end records %x, want %x", got, want)
	}
	if got := vmmMappings(d); !sameMappings(got, want) {
		t.Errorf("VMM mappings %x, want %x", got, want)
	}
}

func TestCheckCacheSize(t *testing.T) {
	for _, c := range []struct {
		size uint64
		ok   bool
	}{
		{2 << 20, true}, {64 << 20, true}, {512 << 20, true},
		{1 << 20, false}, {4096, false}, {3 << 20, false}, {48 << 20, false}, {1 << 30, false}, {1<<21 + 4096, false},
	} {
		if err := CheckCacheSize(c.size); (err == nil) != c.ok {
			t.Errorf("CheckCacheSize(%d) = %v, want ok %v", c.size, err, c.ok)
		}
		_, err := NewBackend(Config{RequestQueues: 1, CacheSize: c.size,
			Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} })})
		if (err == nil) != c.ok {
			t.Errorf("NewBackend with cache size %d: %v, want ok %v", c.size, err, c.ok)
		}
	}
}

// TestWindowFeatures: SHMEM is offered with a window and only then, and a
// window withdraws DEVICE_STATE even with a state to migrate.
func TestWindowFeatures(t *testing.T) {
	for _, c := range []struct {
		cache uint64
		state bool
	}{{0, false}, {0, true}, {2 << 20, false}, {2 << 20, true}} {
		cfg := Config{RequestQueues: 1, CacheSize: c.cache, Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} })}
		if c.state {
			cfg.State = &fakeState{}
		}
		b, err := NewBackend(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if got := b.protoOffered&protoShmem != 0; got != (c.cache > 0) {
			t.Errorf("cache %d: SHMEM offered %v", c.cache, got)
		}
		if got := b.protoOffered&protoDeviceState != 0; got != (c.state && c.cache == 0) {
			t.Errorf("cache %d state %v: DEVICE_STATE offered %v", c.cache, c.state, got)
		}
		if c.cache > 0 && (b.protoOffered&(protoBackendReq|protoReplyAck) != protoBackendReq|protoReplyAck) {
			t.Errorf("cache %d: BACKEND_REQ or REPLY_ACK missing from %#x", c.cache, b.protoOffered)
		}
		if (b.Window() != nil) != (c.cache > 0) || (c.cache > 0 && b.Window().Size() != c.cache) {
			t.Errorf("cache %d: Window() = %v", c.cache, b.Window())
		}
	}
}

// TestShmemConfigAndRefusals: GET_SHMEM_CONFIG answers region 0 with the
// window's size in 2056 bytes; without SHMEM negotiated it is refused (an
// error reply, logged); SET_DEVICE_STATE_FD is refused with a reason.
func TestShmemConfigAndRefusals(t *testing.T) {
	w, d := startWindow(t, nil)
	m, err := d.Conn.Call(vmm.GetShmemConfig, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Payload) != vmm.ShmemConfigSize || binary.LittleEndian.Uint32(m.Payload) != 1 ||
		binary.LittleEndian.Uint64(m.Payload[8:]) != testWindow || bytes.Count(m.Payload[16:], []byte{0}) != len(m.Payload)-16 {
		t.Errorf("GET_SHMEM_CONFIG reply of %d bytes: %x...", len(m.Payload), m.Payload[:24])
	}
	var p [2]int
	err = unix.Pipe2(p[:], unix.O_CLOEXEC)
	if err == nil {
		defer unix.Close(p[0])
		m, err = d.Conn.CallFlags(vmm.SetDeviceStateFd, make([]byte, 8), []int{p[1]}, true)
		unix.Close(p[1])
	}
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := m.U64(); v != 1 {
		t.Errorf("SET_DEVICE_STATE_FD with a window answered %d, want 1", v)
	}
	if !strings.Contains(w.logs.String(), "no migration while a DAX window is offered") {
		t.Error("SET_DEVICE_STATE_FD refused without its reason in the log")
	}

	// A front end that did not ack SHMEM.
	b, err := NewBackend(Config{RequestQueues: 1, CacheSize: testWindow, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} })})
	if err != nil {
		t.Fatal(err)
	}
	d2 := serveOne(t, b, func(sock string) (*vmm.Device, error) { return vmm.Start(sock, vmm.DefaultOptions()) })
	if d2.Window != nil || d2.HasProtocol(vmm.PShmem) {
		t.Fatal("SHMEM negotiated without Options.Shmem")
	}
	m, err = d2.Conn.CallFlags(vmm.GetShmemConfig, nil, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	if v, err := m.U64(); err != nil || v != 1 || len(m.Payload) != 8 {
		t.Errorf("GET_SHMEM_CONFIG without SHMEM: reply %x, want the u64 1 of a refusal", m.Payload)
	}
	if err := b.Window().Map(0, 0, 0, 4096, false); !errors.Is(err, unix.ENODEV) {
		t.Errorf("Map without SHMEM: %v, want ENODEV", err)
	}
}

// TestWindowMapRoundTrip: a map goes to the VMM, which maps the file and
// announces the region with ADD_MEM_REG before it answers (the message loop
// must serve that while the map waits); the mapping shows the file, a
// request whose buffer lies in the window reaches the file both by a Go
// copy and by preadv; overlapping maps replace what was there; unmaps name
// exact mappings; a range that cuts a mapping is EINVAL.
func TestWindowMapRoundTrip(t *testing.T) {
	w, d := startWindow(t, func(d *vmm.Device) vmm.BackendHandler { return d.ServeWindow })
	const M = 1 << 20
	if e := winCall(t, d, 1, mapReq(0, 2*M, 0, 2*M)); e != 0 {
		t.Fatalf("map: %v (VMM: %q)", e, d.WindowErrors())
	}
	checkMappings(t, w, d, [][2]uint64{{0, 2 * M}})
	if got, page := d.Window.Host()[5*4096], (2*M+5*4096)/4096; got != byte(page) {
		t.Errorf("window byte at page 5 is %d: not the file's", got)
	}

	// A reply buffer inside the window: written by a Go copy, then by
	// preadv from the other file, each seen in the mapped file.
	page := vmm.Segment{Addr: d.Window.Base + 3*4096, Len: 4096, Write: true}
	if e := winCall(t, d, 1, winReq{op: opFill, fdOffset: 0xab}, page); e != 0 {
		t.Fatalf("fill a window buffer: %v", e)
	}
	got := make([]byte, 4096)
	if _, err := w.files[0].ReadAt(got, 2*M+3*4096); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{0xab}, 4096)) {
		t.Errorf("file after a Go copy into the window: %x... (%v)", got[:8], err)
	}
	if e := winCall(t, d, 2, winReq{op: opReadFile, file: 1, fdOffset: 7 * 4096}, page); e != 0 {
		t.Fatalf("preadv into a window buffer: %v", e)
	}
	if _, err := w.files[0].ReadAt(got, 2*M+3*4096); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{16 + 7}, 4096)) {
		t.Errorf("file after preadv into the window: %x... (%v)", got[:8], err)
	}

	// Replacement: [2M,4M) then [1M,3M) over both.
	if e := winCall(t, d, 1, mapReq(1, 0, 2*M, 2*M)); e != 0 {
		t.Fatalf("second map: %v", e)
	}
	checkMappings(t, w, d, [][2]uint64{{0, 2 * M}, {2 * M, 2 * M}})
	if e := winCall(t, d, 2, mapReq(1, M, M, 2*M)); e != 0 {
		t.Fatalf("overlapping map: %v (VMM: %q)", e, d.WindowErrors())
	}
	checkMappings(t, w, d, [][2]uint64{{M, 2 * M}})

	// Unmap: a range cutting the mapping, an empty one, then all of it.
	if e := winCall(t, d, 1, winReq{op: opUnmap, winOffset: 0, length: 2 * M}); e != unix.EINVAL {
		t.Errorf("unmap cutting a mapping: %v, want EINVAL", e)
	}
	if e := winCall(t, d, 1, winReq{op: opUnmap, winOffset: 4 * M, length: 4 * M}); e != 0 {
		t.Errorf("unmap of an empty range: %v", e)
	}
	checkMappings(t, w, d, [][2]uint64{{M, 2 * M}})
	if e := winCall(t, d, 1, winReq{op: opUnmap, winOffset: 0, length: 4 * M}); e != 0 {
		t.Errorf("unmap: %v (VMM: %q)", e, d.WindowErrors())
	}
	checkMappings(t, w, d, nil)
	// Misuse is EINVAL before anything is sent; the VMM's refusal EIO.
	for _, r := range []winReq{
		mapReq(0, 0, 0, 3*4096),             // fine
		mapReq(0, 0, 4095, 4096),            // misaligned
		mapReq(0, 0, testWindow-4096, 8192), // past the end
		mapReq(0, 0, 0, 0),                  // empty
		mapReq(0, 4<<20, 4096, 4096),        // past the file's end: the VMM refuses
	} {
		want := unix.EINVAL
		switch {
		case r.winOffset == 0 && r.length > 0:
			want = 0
		case r.fdOffset == 4<<20:
			want = unix.EIO
		}
		if e := winCall(t, d, 1, r); e != want {
			t.Errorf("map %+v: %v, want %v", r, e, want)
		}
	}
	if e := winCall(t, d, 1, winReq{op: opUnmapAll}); e != 0 {
		t.Fatal(e)
	}
	checkMappings(t, w, d, nil)
}

// TestWindowBound: no more than 2 records per 2 MiB slot, and no more than
// the memory slots leave beside RAM.
func TestWindowBound(t *testing.T) {
	for size, want := range map[uint64]int{2 << 20: 2, 64 << 20: 64, 256 << 20: 256, 512 << 20: maxMemSlots - maxTableRegions} {
		b, err := NewBackend(Config{RequestQueues: 1, CacheSize: size, Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} })})
		if err != nil {
			t.Fatal(err)
		}
		if b.window.max != want {
			t.Errorf("window of %d MiB: bound %d, want %d", size>>20, b.window.max, want)
		}
	}
	w, d := startWindow(t, func(d *vmm.Device) vmm.BackendHandler { return d.ServeWindow })
	max := 2 * testWindow / (2 << 20)
	for i := range max {
		if e := winCall(t, d, 1, mapReq(0, 0, uint64(i)*4096, 4096)); e != 0 {
			t.Fatalf("map %d: %v", i, e)
		}
	}
	if e := winCall(t, d, 1, mapReq(0, 0, uint64(max)*4096, 4096)); e != unix.ENOSPC {
		t.Errorf("map beyond %d records: %v, want ENOSPC", max, e)
	}
	// Replacing one is fine.
	if e := winCall(t, d, 1, mapReq(0, 4096, 0, 4096)); e != 0 {
		t.Errorf("replacing map at the bound: %v", e)
	}
	if n := len(w.b.Window().Mappings()); n != max {
		t.Errorf("%d records, want %d", n, max)
	}
}

// TestWindowForget: RESET_DEVICE and a new back-end channel forget the
// records without a message to the VMM.
func TestWindowForget(t *testing.T) {
	var unmaps atomic.Int32
	w, d := startWindow(t, func(d *vmm.Device) vmm.BackendHandler {
		return func(m *vmm.Message) uint64 {
			if m.Request == vmm.BackendShmemUnmap {
				unmaps.Add(1)
			}
			return d.ServeWindow(m)
		}
	})
	if e := winCall(t, d, 1, mapReq(0, 0, 0, 2<<20)); e != 0 {
		t.Fatal(e)
	}
	if _, err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := d.Conn.ResetDevice(); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Conn.GetFeatures(); err != nil { // RESET_DEVICE handled
		t.Fatal(err)
	}
	if n := len(w.b.Window().Mappings()); n != 0 {
		t.Errorf("%d records after RESET_DEVICE", n)
	}
	if !strings.Contains(w.logs.String(), "why=\"device reset\"") {
		t.Error("forgetting not logged")
	}
	if n := unmaps.Load(); n != 0 {
		t.Errorf("%d SHMEM_UNMAP sent on RESET_DEVICE", n)
	}
}

// TestWindowHostileReplies: a reply to another request, no reply at all
// (bounded wait) and a refusal each fail the map with EIO and leave the
// channel usable; a late reply is discarded before the next request.
func TestWindowHostileReplies(t *testing.T) {
	type behaviour int
	const (
		wrongID behaviour = iota
		silent
		refuse
		ok
	)
	var mu sync.Mutex
	mode := wrongID
	var late []*vmm.Message
	w, d := startWindowWait(t, nil, 300*time.Millisecond)
	go func() {
		for {
			m, err := d.Backend.RecvTimeout(-1)
			if err != nil {
				return
			}
			m.CloseFds()
			mu.Lock()
			md := mode
			mu.Unlock()
			switch md {
			case wrongID:
				d.Backend.SendRaw(vmm.Header{Request: m.Request + 1, Flags: vmm.ReplyFlags, Size: 8}, vmm.U64(0), nil)
			case silent:
				mu.Lock()
				late = append(late, m)
				mu.Unlock()
			case refuse:
				d.Backend.Reply(m, vmm.U64(1))
			case ok:
				d.Backend.Reply(m, vmm.U64(0))
			}
		}
	}()
	for _, c := range []struct {
		b    behaviour
		want unix.Errno
		recs int
	}{{wrongID, unix.EIO, 0}, {refuse, unix.EIO, 0}, {silent, unix.EIO, 1}, {ok, 0, 1}} {
		mu.Lock()
		mode = c.b
		if c.b == ok {
			for _, l := range late { // the late answer, before the next request
				d.Backend.Reply(l, vmm.U64(0))
			}
			late = nil
		}
		mu.Unlock()
		start := time.Now()
		if e := winCall(t, d, 1, mapReq(0, 0, 0, 2<<20)); e != c.want {
			t.Errorf("behaviour %d: map %v, want %v", c.b, e, c.want)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("behaviour %d: map took %v", c.b, el)
		}
		// A silent VMM may have mapped: the record stays so the range
		// is unmapped before it is mapped again.
		if n := len(w.b.Window().Mappings()); n != c.recs {
			t.Errorf("behaviour %d: %d records, want %d", c.b, n, c.recs)
		}
	}
}

// TestWindowRingStopCancelsMap: GET_VRING_BASE while a map waits for a VMM
// that answers only after it (QEMU's main loop is busy sending
// GET_VRING_BASE) returns at once, the map fails with EIO, and the late
// answer is discarded before the next request, which works.
func TestWindowRingStopCancelsMap(t *testing.T) {
	got := make(chan *vmm.Message, 4)
	w, d := startWindow(t, nil)
	go func() {
		for {
			m, err := d.Backend.RecvTimeout(-1)
			if err != nil {
				return
			}
			m.CloseFds()
			got <- m
		}
	}()
	c, st := winSubmit(t, d, 1, mapReq(0, 0, 0, 2<<20))
	var m *vmm.Message
	select {
	case m = <-got:
	case <-time.After(5 * time.Second):
		t.Fatal("no SHMEM_MAP sent")
	}
	if m.Request != vmm.BackendShmemMap || m.Flags&vmm.FlagNeedReply == 0 {
		t.Fatalf("got request %v flags %#x", m.Request, m.Flags)
	}
	s, err := vmm.ParseShmemMsg(m.Payload)
	if err != nil || s.Len != 2<<20 || s.Flags != vmm.ShmemWritable || s.ShmID != 0 {
		t.Fatalf("SHMEM_MAP body %+v (%v)", s, err)
	}
	start := time.Now()
	base, err := d.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("GET_VRING_BASE took %v behind a waiting map", el)
	}
	if _, err := c.Wait(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if e := winStatus(t, d, st); e != unix.EIO {
		t.Errorf("cancelled map: %v, want EIO", e)
	}
	d.Backend.Reply(m, vmm.U64(0)) // the late answer
	if err := d.RestartQueue(1, base, false); err != nil {
		t.Fatal(err)
	}
	// The record of the cancelled map makes the next map unmap first.
	c, st = winSubmit(t, d, 1, mapReq(0, 0, 0, 2<<20))
	for _, want := range []vmm.Request{vmm.BackendShmemUnmap, vmm.BackendShmemMap} {
		select {
		case m = <-got:
		case <-time.After(5 * time.Second):
			t.Fatalf("no %v sent", want)
		}
		if m.Request != want {
			t.Fatalf("got %v, want %v", m.Request, want)
		}
		d.Backend.Reply(m, vmm.U64(0))
	}
	if _, err := c.Wait(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if e := winStatus(t, d, st); e != 0 {
		t.Errorf("map after the cancelled one: %v", e)
	}
	if n := len(w.b.Window().Mappings()); n != 1 {
		t.Errorf("%d records, want 1", n)
	}
}

// TestWindowRegionHeldByRequest: a REM_MEM_REG of a window region while a
// request writes into it does not unmap it under the request: the table
// is refcounted, the request completes and its bytes reach the file.
func TestWindowRegionHeldByRequest(t *testing.T) {
	w, d := startWindow(t, func(d *vmm.Device) vmm.BackendHandler { return d.ServeWindow })
	if e := winCall(t, d, 1, mapReq(0, 0, 0, 2<<20)); e != 0 {
		t.Fatal(e)
	}
	page := vmm.Segment{Addr: d.Window.Base + 4096, Len: 4096, Write: true}
	c, st := winSubmit(t, d, 2, winReq{op: opHoldFill, fdOffset: 0x5a}, page)
	select {
	case <-w.holding:
	case <-time.After(5 * time.Second):
		t.Fatal("request not served")
	}
	// QEMU's REM_MEM_REG (as after an unmap), the region's fd attached.
	ms := d.Window.Mappings()
	reg := vmm.MemRegion{GuestPhysAddr: d.Window.Base, MemorySize: 2 << 20, UserAddr: 0x6000_0000_0000, MmapOffset: 0}
	if err := d.Conn.RemMemReg(reg, int(w.files[0].Fd())); err != nil {
		t.Fatal(err)
	}
	close(w.hold)
	if _, err := c.Wait(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if e := winStatus(t, d, st); e != 0 {
		t.Errorf("request holding the removed region: %v", e)
	}
	got := make([]byte, 4096)
	if _, err := w.files[0].ReadAt(got, 4096); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{0x5a}, 4096)) {
		t.Errorf("file after the held write: %x... (%v)", got[:8], err)
	}
	if len(ms) != 1 {
		t.Fatalf("VMM mappings %v", ms)
	}
	// Now gone from the table: a new request there is not translated.
	c, st = winSubmit(t, d, 2, winReq{op: opFill, fdOffset: 0x77}, page)
	if _, err := c.Wait(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if e := winStatus(t, d, st); e == 0 {
		if _, err := w.files[0].ReadAt(got, 4096); err == nil && got[0] == 0x77 {
			t.Error("a buffer in a removed region was still written")
		}
	}
}

// FuzzWindowReplies: whatever the VMM writes back on the back-end channel
// (the map/unmap replies are the one new decoder of VMM input), Map, Unmap
// and UnmapAll return an errno or nil, never hang or panic, and the
// records stay sorted, disjoint, inside the window and within the bound.
func FuzzWindowReplies(f *testing.F) {
	ack := func(req uint32, v uint64) []byte {
		b := binary.LittleEndian.AppendUint32(nil, req)
		b = binary.LittleEndian.AppendUint32(b, 0x5)
		b = binary.LittleEndian.AppendUint32(b, 8)
		return binary.LittleEndian.AppendUint64(b, v)
	}
	f.Add(append(ack(9, 0), ack(10, 0)...))
	f.Add(append(append(ack(9, 0), ack(10, 1)...), ack(9, 0)...))
	f.Add(ack(9, 1))
	f.Add(ack(10, 0))
	f.Add([]byte{9, 0, 0, 0, 5, 0, 0, 0, 0xff, 0xff, 0, 0})
	f.Add(append(ack(9, 0)[:12], 1, 2, 3))
	f.Fuzz(func(t *testing.T, replies []byte) {
		b, err := NewBackend(Config{RequestQueues: 1, CacheSize: testWindow, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
			Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} })})
		if err != nil {
			t.Fatal(err)
		}
		b.window.wait = 20 * time.Millisecond
		b.channel.staleWait = 20 * time.Millisecond
		b.window.regionWait = time.Millisecond
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		b.channel.set(fds[0])
		b.window.usable.Store(true)
		peer := os.NewFile(uintptr(fds[1]), "vmm")
		defer peer.Close()
		peer.Write(replies)
		unix.Shutdown(fds[1], unix.SHUT_WR) // then EOF: no wait runs out
		go io.Copy(io.Discard, peer)        // our requests
		file, err := os.CreateTemp(t.TempDir(), "map")
		if err != nil {
			t.Fatal(err)
		}
		defer file.Close()
		w := b.Window()
		check := func(err error) {
			var errno unix.Errno
			if err != nil && !errors.As(err, &errno) {
				t.Fatalf("error %v (%T) is not an errno", err, err)
			}
			ms := w.Mappings()
			if len(ms) > w.max {
				t.Fatalf("%d records, bound %d", len(ms), w.max)
			}
			for i, m := range ms {
				if m[1] == 0 || m[0]+m[1] > w.Size() || (i > 0 && ms[i-1][0]+ms[i-1][1] > m[0]) {
					t.Fatalf("records %x", ms)
				}
			}
		}
		const M = 1 << 20
		check(w.Map(int(file.Fd()), 0, 0, 2*M, true))
		check(w.Map(int(file.Fd()), 0, 2*M, 2*M, false))
		check(w.Map(int(file.Fd()), 0, M, 2*M, true))
		check(w.Unmap(0, 2*M))
		check(w.Unmap(0, testWindow))
		w.UnmapAll()
		check(nil)
		b.channel.close()
	})
}

// TestWindowHostTruncate: the host truncates a file under a window region
// the back end mapped from ADD_MEM_REG. A request whose buffer lies past
// the new end fails with EFAULT when a syscall moves the data (preadv,
// as READ does) and the ring goes on; a Go copy into it (as a reply
// header would be written) faults: the server recovers (panic on fault),
// the chain is lost with its ring, and the daemon lives.
func TestWindowHostTruncate(t *testing.T) {
	w, d := startWindow(t, nil)
	dev := d
	f, err := os.Create(filepath.Join(t.TempDir(), "mapped"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(2 << 20); err != nil {
		t.Fatal(err)
	}
	if err := dev.MapWindow(vmm.ShmemMsg{ShmOffset: 0, Len: 2 << 20, Flags: vmm.ShmemWritable}, int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	page := vmm.Segment{Addr: d.Window.Base + 1<<20, Len: 4096, Write: true}
	if e := winCall(t, d, 1, winReq{op: opReadFile, file: 1, fdOffset: 0}, page); e != 0 {
		t.Fatalf("preadv into the window before the truncate: %v", e)
	}
	if err := f.Truncate(4096); err != nil {
		t.Fatal(err)
	}
	if e := winCall(t, d, 1, winReq{op: opReadFile, file: 1, fdOffset: 0}, page); e != unix.EFAULT {
		t.Errorf("preadv into a truncated window page: %v, want EFAULT", e)
	}
	c, _ := winSubmit(t, d, 2, winReq{op: opFill, fdOffset: 1}, page)
	if _, err := c.Wait(time.Second); err == nil {
		t.Error("a Go copy into a truncated window page completed")
	}
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(w.logs.String(), "fault on guest memory; ring stopped"); {
		if time.Now().After(deadline) {
			t.Fatalf("no fault logged:\n%s", w.logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The daemon goes on: ring 1 serves, the message loop answers.
	if e := winCall(t, d, 1, winReq{op: opFill, fdOffset: 2}, vmm.Segment{Addr: d.Window.Base, Len: 4096, Write: true}); e != 0 {
		t.Errorf("a Go copy into the window page still backed: %v", e)
	}
	if _, err := d.Conn.GetFeatures(); err != nil {
		t.Fatal(err)
	}
}

// TestRingMemoryFaultSparesMessageLoop: a guest can put its rings in a DAX
// window page and truncate the file behind it; the message loop, which
// reads a ring's indices when it starts and stops it, must fail that
// message, not the daemon. Here the memfd holding the rings shrinks
// (region 0 of the front end), then the ring is stopped and started.
func TestRingMemoryFaultSparesMessageLoop(t *testing.T) {
	w, d := startWindow(t, nil)
	if _, err := d.Conn.GetFeatures(); err != nil { // every start-up message handled
		t.Fatal(err)
	}
	if err := unix.Ftruncate(d.Mem.Regions()[0].Fd(), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := d.StopQueue(1); err != nil {
		t.Fatalf("GET_VRING_BASE on a ring whose memory faults: %v", err)
	}
	err := d.RestartQueue(1, 0, false)
	t.Logf("ring restarted on faulting memory: %v", err)
	if _, err := d.Conn.GetFeatures(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(w.logs.String(), "fault on guest memory") {
		t.Errorf("no fault logged:\n%s", w.logs.String())
	}
}

// TestWindowResetDuringMap: RESET_DEVICE and a new SET_BACKEND_REQ_FD,
// which forget the window's records, complete at once while a map waits
// for an answer (they never take what the waiting map holds), and the
// map fails with EIO and records nothing.
func TestWindowResetDuringMap(t *testing.T) {
	for _, reset := range []string{"RESET_DEVICE", "SET_BACKEND_REQ_FD"} {
		t.Run(reset, func(t *testing.T) {
			got := make(chan *vmm.Message, 4)
			w, d := startWindow(t, nil)
			go func() {
				for {
					m, err := d.Backend.RecvTimeout(-1)
					if err != nil {
						return
					}
					m.CloseFds()
					got <- m
				}
			}()
			c, st := winSubmit(t, d, 1, mapReq(0, 0, 0, 2<<20))
			select {
			case <-got:
			case <-time.After(5 * time.Second):
				t.Fatal("no SHMEM_MAP sent")
			}
			start := time.Now()
			var err error
			if reset == "RESET_DEVICE" {
				err = d.Conn.ResetDevice()
			} else {
				ours, theirs, perr := vmm.SocketPair()
				if perr != nil {
					t.Fatal(perr)
				}
				defer ours.Close()
				err = d.Conn.SetBackendReqFd(int(theirs.Fd()))
				theirs.Close()
			}
			if err != nil {
				t.Fatal(err)
			}
			if el := time.Since(start); el > 2*time.Second {
				t.Errorf("%s took %v behind a waiting map", reset, el)
			}
			if _, err := c.Wait(5 * time.Second); err != nil {
				t.Fatal(err)
			}
			if e := winStatus(t, d, st); e != unix.EIO {
				t.Errorf("map across %s: %v, want EIO", reset, e)
			}
			if n := len(w.b.Window().Mappings()); n != 0 {
				t.Errorf("%d records after %s", n, reset)
			}
		})
	}
}

// TestWindowMapWaitsForRegion: QEMU 11.1 answers SHMEM_MAP before it sends
// the mapping's ADD_MEM_REG; Map returns only once the region is in the
// memory table (a guest may use the page at once). (A region that never
// comes ends the wait after the bound: TestWindowHostileReplies.)
func TestWindowMapWaitsForRegion(t *testing.T) {
	const delay = 300 * time.Millisecond
	w, d := startWindowRegion(t, nil, mapReplyWait, 5*time.Second)
	var sent atomic.Int32
	d.ServeBackend(func(m *vmm.Message) uint64 {
		s, err := vmm.ParseShmemMsg(m.Payload)
		if err != nil || m.Request != vmm.BackendShmemMap || len(m.Fds) != 1 {
			return 1
		}
		fd, err := unix.FcntlInt(uintptr(m.Fds[0]), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return 1
		}
		go func() { // the answer first, the region later
			defer unix.Close(fd)
			time.Sleep(delay)
			r := vmm.MemRegion{GuestPhysAddr: d.Window.Base + s.ShmOffset, MemorySize: s.Len, UserAddr: 0x6000_0000_0000 + s.ShmOffset, MmapOffset: s.FdOffset}
			sent.Add(1)
			if err := d.Conn.AddMemReg(r, fd); err != nil {
				sent.Add(100)
			}
		}()
		return 0
	})
	start := time.Now()
	if e := winCall(t, d, 1, mapReq(0, 0, 0, 2<<20)); e != 0 {
		t.Fatal(e)
	}
	if el := time.Since(start); el < delay || sent.Load() != 1 {
		t.Errorf("map returned after %v, before its region (sent %d)", el, sent.Load())
	}
	// The page is translated at once.
	if e := winCall(t, d, 2, winReq{op: opFill, fdOffset: 0x3c}, vmm.Segment{Addr: d.Window.Base + 8192, Len: 4096, Write: true}); e != 0 {
		t.Errorf("a buffer in the new mapping: %v", e)
	}
	got := make([]byte, 1)
	if _, err := w.files[0].ReadAt(got, 8192); err != nil || got[0] != 0x3c {
		t.Errorf("file byte %x (%v), want 3c", got, err)
	}
}
