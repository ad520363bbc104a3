package vhostuser

import (
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// echoHandler answers every request with as many zero bytes as fit, up to 16.
type echoHandler struct{}

func (echoHandler) Serve(in, out *bufvec.Vec) uint32 {
	n := min(out.Len(), 16)
	if out.Zero(n) != nil {
		return 0
	}
	return uint32(n)
}

func newTestBackend(t testing.TB, tag string) *Backend {
	b, err := NewBackend(Config{
		RequestQueues: 2,
		Tag:           tag,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler:       HandlerFunc(func(int) RequestHandler { return echoHandler{} }),
		State:         &fakeState{save: []byte("STATE")},
	})
	if err != nil {
		t.Fatal(err)
	}
	// A transfer through an fd that never moves (an eventfd) must not
	// hold the message loop for the production minute.
	b.transferStall = 50 * time.Millisecond
	return b
}

// socketPair returns the back end's end as a *net.UnixConn and the front
// end's raw fd.
func socketPair(t testing.TB) (*net.UnixConn, int) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[0]), "backend")
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	return c.(*net.UnixConn), fds[1]
}

// fuzzFD makes an fd of the kind selected by k: a small memfd (guest
// memory), an eventfd (kick/call) or a pipe end (nonsense).
func fuzzFD(t testing.TB, k byte) int {
	switch k % 3 {
	case 0:
		fd, err := unix.MemfdCreate("fuzz-mem", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Ftruncate(fd, 1<<16); err != nil {
			t.Fatal(err)
		}
		return fd
	case 1:
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
		if err != nil {
			t.Fatal(err)
		}
		return fd
	default:
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		unix.Close(p[1])
		return p[0]
	}
}

// FuzzMessages feeds a stream of vhost-user messages, each with fuzz-chosen
// fds attached, to a live Backend. The back end must never panic, must keep
// answering, and must return from Serve when the stream ends.
func FuzzMessages(f *testing.F) {
	msg := func(req, flags uint32, payload []byte) []byte {
		b := make([]byte, 12+len(payload))
		binary.LittleEndian.PutUint32(b[0:], req)
		binary.LittleEndian.PutUint32(b[4:], flags)
		binary.LittleEndian.PutUint32(b[8:], uint32(len(payload)))
		copy(b[12:], payload)
		return b
	}
	u64 := func(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }
	st := func(i, n uint32) []byte {
		return binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, i), n)
	}
	region := func(gpa, size, uva, off uint64) []byte {
		b := binary.LittleEndian.AppendUint64(nil, gpa)
		b = binary.LittleEndian.AppendUint64(b, size)
		b = binary.LittleEndian.AppendUint64(b, uva)
		return binary.LittleEndian.AppendUint64(b, off)
	}
	addr := func(i uint32, desc, used, avail uint64) []byte {
		b := st(i, 0)
		for _, v := range []uint64{desc, used, avail, 0} {
			b = binary.LittleEndian.AppendUint64(b, v)
		}
		return b
	}
	var start []byte
	start = append(start, msg(reqGetFeatures, 1, nil)...)
	start = append(start, msg(reqSetProtocolFeatures, 1, u64(protoReplyAck|protoConfigureMemSlots))...)
	start = append(start, msg(reqSetFeatures, 1, u64(featVersion1|featEventIdx|featIndirectDesc|featProtocolFeatures))...)
	start = append(start, msg(reqAddMemReg, 9, append(make([]byte, 8), region(0, 1<<16, 0x7f0000000000, 0)...))...)
	start = append(start, msg(reqSetVringNum, 1, st(1, 16))...)
	start = append(start, msg(reqSetVringAddr, 1, addr(1, 0x7f0000000000, 0x7f0000001000, 0x7f0000000100))...)
	start = append(start, msg(reqSetVringKick, 1, u64(1))...)
	start = append(start, msg(reqSetVringCall, 1, u64(1))...)
	start = append(start, msg(reqSetVringEnable, 1, st(1, 1))...)
	start = append(start, msg(reqGetVringBase, 1, st(1, 0))...)
	f.Add(start, []byte{0, 0, 0, 0, 1, 0, 1, 1, 0, 0})
	table := binary.LittleEndian.AppendUint32(nil, 2)
	table = append(table, 0, 0, 0, 0)
	table = append(table, region(0, 1<<15, 0x1000, 0)...)
	table = append(table, region(1<<15, 1<<15, 0x100000, 1<<15)...)
	f.Add(msg(reqSetMemTable, 9, table), []byte{2})
	// Migration: the log, LOG_ALL, a state transfer and its check.
	var mig []byte
	mig = append(mig, msg(reqSetProtocolFeatures, 1, u64(protoReplyAck|protoLogShmFD|protoDeviceState))...)
	mig = append(mig, msg(reqSetLogBase, 9, append(u64(4096), u64(0)...))...)
	mig = append(mig, msg(reqSetFeatures, 9, u64(featVersion1|featProtocolFeatures|featLogAll))...)
	mig = append(mig, msg(reqSetDeviceStateFD, 1, st(transferLoad, phaseStopped))...)
	mig = append(mig, msg(reqCheckDeviceState, 1, nil)...)
	mig = append(mig, msg(reqSetDeviceStateFD, 1, st(transferSave, phaseStopped))...)
	mig = append(mig, msg(reqCheckDeviceState, 1, nil)...)
	f.Add(mig, []byte{0, 0x12, 0, 0x11, 0, 0x11, 0}) // a memfd log, pipe ends
	f.Add(msg(reqGetConfig, 1, append(st(0, 40), append(make([]byte, 4), make([]byte, 40)...)...)), []byte{0})
	f.Add(msg(reqRemMemReg, 9, append(make([]byte, 8), region(0, 1<<16, 0, 0)...)), []byte{1})
	f.Add(msg(99, 9, nil), []byte{3})
	f.Add([]byte{1, 0, 0}, []byte{})

	f.Fuzz(func(t *testing.T, stream, fdPlan []byte) {
		b := newTestBackend(t, "fuzz")
		conn, peer := socketPair(t)
		defer unix.Close(peer)
		done := make(chan error, 1)
		go func() { done <- b.Serve(conn) }()
		go func() { // drain replies so the back end never blocks on us
			var buf [4096]byte
			for {
				if _, err := unix.Read(peer, buf[:]); err != nil {
					return
				}
			}
		}()
		// Send message by message so fds travel with the right one.
		plan := 0
		for off := 0; off < len(stream); {
			n := len(stream) - off
			if n >= 12 {
				size := int(binary.LittleEndian.Uint32(stream[off+8:]))
				n = min(n, 12+min(size, 4096))
			}
			var fds []int
			if plan < len(fdPlan) {
				k := fdPlan[plan]
				plan++
				for i := 0; i < int(k>>4)%4; i++ {
					fds = append(fds, fuzzFD(t, k+byte(i)))
				}
			}
			var oob []byte
			if len(fds) > 0 {
				oob = unix.UnixRights(fds...)
			}
			err := unix.Sendmsg(peer, stream[off:off+n], oob, nil, 0)
			for _, fd := range fds {
				unix.Close(fd)
			}
			if err != nil {
				break
			}
			off += n
		}
		unix.Shutdown(peer, unix.SHUT_WR)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("Serve did not return after the front end closed")
		}
		conn.Close()
	})
}
