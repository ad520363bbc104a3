package vhostuser

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// fakeState is a DeviceState whose state is opaque bytes: what it saves is
// save; it loads anything that starts with "STATE" and refuses the rest.
type fakeState struct {
	mu     sync.Mutex
	save   []byte
	loaded []byte
	logAll []bool
}

func (f *fakeState) LogAll(on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.logAll = append(f.logAll, on)
}

func (f *fakeState) SaveState(w io.Writer) error {
	_, err := w.Write(f.save)
	return err
}

func (f *fakeState) LoadState(r io.Reader) error {
	b, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	if !bytes.HasPrefix(b, []byte("STATE")) {
		return errors.New("not a state")
	}
	f.mu.Lock()
	f.loaded = b
	f.mu.Unlock()
	return nil
}

func (f *fakeState) loadedState() []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.loaded
}

func (f *fakeState) logAllCalls() []bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]bool(nil), f.logAll...)
}

// migrationOptions is the vmm device as QEMU 10 drives it: DEVICE_STATE
// acknowledged besides QEMU 7.2's protocol features.
func migrationOptions() vmm.Options {
	o := vmm.DefaultOptions()
	o.ProtocolFeatures |= vmm.Bit(vmm.PDeviceState)
	o.Timeout = 10 * time.Second
	return o
}

// startStateBackend serves a back end with state st and returns a vmm
// device connected to it, initialised but with no ring started when start
// is false.
func startStateBackend(t *testing.T, st DeviceState, start bool) *vmm.Device {
	t.Helper()
	return startStateBackendStall(t, st, start, transferStall)
}

// startStateBackendStall is startStateBackend with the given stall limit.
func startStateBackendStall(t *testing.T, st DeviceState, start bool, stall time.Duration) *vmm.Device {
	t.Helper()
	b, err := NewBackend(Config{RequestQueues: 1, Tag: "state", State: st,
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} })})
	if err != nil {
		t.Fatal(err)
	}
	b.transferStall = stall
	d := serveOne(t, b, func(sock string) (*vmm.Device, error) { return vmm.Connect(sock, migrationOptions()) })
	if err := d.Init(); err != nil {
		t.Fatal(err)
	}
	if !d.HasProtocol(vmm.PDeviceState) || !d.HasProtocol(vmm.PLogShmfd) {
		t.Fatalf("protocol features %#x: DEVICE_STATE or LOG_SHMFD not negotiated", d.ProtocolFeatures)
	}
	if start {
		if err := d.StartRings(); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

// echoes checks ring 1 serves a request.
func echoes(t *testing.T, d *vmm.Device) {
	t.Helper()
	in := vmm.BuildRequest(vmm.InHeader{Opcode: 1234, Unique: 9}, 0)
	if _, err := d.Do(1, in, nil, 64); err != nil {
		t.Fatalf("ring 1 does not serve: %v", err)
	}
}

// openFDs counts this process's fds (the back end's included) once the
// back end has handled every message sent so far: a GET_FEATURES answered
// comes after them.
func openFDs(t *testing.T, d *vmm.Device) int {
	t.Helper()
	if _, err := d.Conn.GetFeatures(); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestStateSaveLoad: a state larger than a pipe's buffer goes from one back
// end to another as QEMU moves it (source: rings stopped, save, check;
// destination: load before any ring starts, check), and the destination
// then serves.
func TestStateSaveLoad(t *testing.T) {
	state := append([]byte("STATE"), bytes.Repeat([]byte("0123456789abcdef"), 1<<16)...) // 1 MiB
	src := &fakeState{save: state}
	sd := startStateBackend(t, src, true)
	echoes(t, sd)
	if _, err := sd.Stop(); err != nil {
		t.Fatal(err)
	}
	got, err := sd.SaveState()
	if err != nil {
		t.Fatalf("save: %v", err)
	}
	if !bytes.Equal(got, state) {
		t.Fatalf("saved %d bytes, want the %d the state wrote", len(got), len(state))
	}
	dst := &fakeState{}
	dd := startStateBackend(t, dst, false)
	if err := dd.LoadState(got); err != nil {
		t.Fatalf("load: %v", err)
	}
	if !bytes.Equal(dst.loadedState(), state) {
		t.Fatalf("loaded %d bytes, want %d", len(dst.loadedState()), len(state))
	}
	if err := dd.StartRings(); err != nil {
		t.Fatal(err)
	}
	echoes(t, dd)
	// The source resumes (a failed or cancelled migration).
	if err := sd.Restart(false); err != nil {
		t.Fatal(err)
	}
	echoes(t, sd)
}

// TestStateLoadRefused: a state the device refuses fails CHECK_DEVICE_STATE
// (the destination QEMU then fails the migration); the back end goes on.
func TestStateLoadRefused(t *testing.T) {
	dst := &fakeState{}
	d := startStateBackend(t, dst, false)
	before := openFDs(t, d)
	for _, garbage := range [][]byte{nil, []byte("x"), bytes.Repeat([]byte{0xff}, 200000)} {
		err := d.LoadState(garbage)
		var re *vmm.ReplyError
		if !errors.As(err, &re) || re.Request != vmm.CheckDeviceState {
			t.Errorf("load of %d garbage bytes: %v, want CHECK_DEVICE_STATE to fail", len(garbage), err)
		}
	}
	if dst.loadedState() != nil {
		t.Errorf("garbage was installed")
	}
	if after := openFDs(t, d); after > before {
		t.Errorf("fds grew from %d to %d", before, after)
	}
	if err := d.StartRings(); err != nil {
		t.Fatal(err)
	}
	echoes(t, d)
}

// TestStateMessagesRefused: malformed SET_DEVICE_STATE_FD and
// CHECK_DEVICE_STATE are answered with an error and change nothing.
func TestStateMessagesRefused(t *testing.T) {
	d := startStateBackend(t, &fakeState{save: []byte("STATE")}, true)
	pipe := func() (int, int) {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(p[0]); unix.Close(p[1]) })
		return p[0], p[1]
	}
	r, w := pipe()
	before := openFDs(t, d)
	refused := func(what string, v uint64, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if v&0xff == 0 {
			t.Errorf("%s: answered %#x, want an error", what, v)
		}
	}
	v, err := d.SetDeviceStateFD(vmm.TransferSave, vmm.PhaseStopped, w)
	refused("save while the rings run", v, err)
	if _, err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	v, err = d.SetDeviceStateFD(vmm.TransferSave, vmm.PhaseStopped)
	refused("no fd", v, err)
	v, err = d.SetDeviceStateFD(vmm.TransferSave, vmm.PhaseStopped, w, r)
	refused("two fds", v, err)
	v, err = d.SetDeviceStateFD(2, vmm.PhaseStopped, w)
	refused("direction 2", v, err)
	v, err = d.SetDeviceStateFD(vmm.TransferLoad, 1, r)
	refused("phase 1", v, err)
	for _, n := range []int{0, 4, 7} {
		m, err := d.Conn.Call(vmm.SetDeviceStateFd, make([]byte, n), []int{w})
		if err != nil {
			t.Fatalf("%d-byte payload: %v", n, err)
		}
		m.CloseFds()
		v, _ := m.U64()
		refused("short payload", v, nil)
	}
	var re *vmm.ReplyError
	if err := d.CheckDeviceState(); !errors.As(err, &re) {
		t.Errorf("CHECK_DEVICE_STATE without a transfer: %v, want an error", err)
	}
	if after := openFDs(t, d); after > before {
		t.Errorf("fds grew from %d to %d: refused messages' fds leak", before, after)
	}
	// The back end is in step and its state still transfers.
	if got, err := d.SaveState(); err != nil || string(got) != "STATE" {
		t.Errorf("save after the refusals: %q, %v", got, err)
	}
	if err := d.Restart(false); err != nil {
		t.Fatal(err)
	}
	echoes(t, d)
}

// TestStateStalledTransfer: a front end that never closes the pipe of a
// load fails the transfer after transferStall instead of holding the
// message loop forever; one that disconnects mid-transfer ends it at once.
func TestStateStalledTransfer(t *testing.T) {
	d := startStateBackendStall(t, &fakeState{}, false, 200*time.Millisecond)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	v, err := d.SetDeviceStateFD(vmm.TransferLoad, vmm.PhaseStopped, int(r.Fd()))
	r.Close()
	if err != nil || v&0xff != 0 {
		t.Fatalf("load: %#x, %v", v, err)
	}
	w.Write([]byte("STATE and then nothing"))
	start := time.Now()
	var re *vmm.ReplyError
	if err := d.CheckDeviceState(); !errors.As(err, &re) {
		t.Errorf("CHECK after a stalled load: %v, want an error", err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("CHECK took %v", el)
	}
	if err := d.StartRings(); err != nil {
		t.Fatal(err)
	}
	echoes(t, d)
}

// TestLogAllReachesState: the device state hears when logging starts and
// stops (it collects what it will save while the VM still runs).
func TestLogAllReachesState(t *testing.T) {
	st := &fakeState{}
	d := startStateBackend(t, st, true)
	l, err := vmm.NewDirtyLogFor(d.Mem)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := d.StartLogging(l); err != nil {
		t.Fatal(err)
	}
	echoes(t, d)
	if err := d.StopLogging(); err != nil {
		t.Fatal(err)
	}
	if got := st.logAllCalls(); len(got) != 2 || !got[0] || got[1] {
		t.Errorf("LogAll calls %v, want [true false]", got)
	}
	if len(l.Pages()) == 0 {
		t.Errorf("nothing logged while logging was on")
	}
}
