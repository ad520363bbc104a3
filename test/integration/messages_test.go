package integration

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// ackAll returns options under which every message without a reply of its
// own carries NEED_REPLY, so each one's outcome is visible.
func ackAll() vmm.Options {
	o := opts()
	o.Ack = vmm.AckAll
	return o
}

func memfd(t *testing.T, size int64) int {
	t.Helper()
	fd, err := unix.MemfdCreate("integration", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

func eventfd(t *testing.T) int {
	t.Helper()
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// mustRefuse sends req with NEED_REPLY and expects a REPLY_ACK failure.
func mustRefuse(t *testing.T, dev *vmm.Device, what string, req vmm.Request, payload []byte, fds ...int) {
	t.Helper()
	m, err := dev.Conn.CallFlags(req, payload, fds, true)
	if req.HasReply() {
		// Requests vmm expects a reply from anyway: the ack is that reply.
		if err != nil {
			t.Errorf("%s: %v", what, err)
			return
		}
		m.CloseFds()
		if v, err := m.U64(); err != nil || v == 0 {
			t.Errorf("%s: ack %d, %v; want a failure", what, v, err)
		}
		return
	}
	if replyErr(err) == 0 {
		t.Errorf("%s: %v, want a REPLY_ACK failure", what, err)
	}
}

// mustAccept sends req with NEED_REPLY and expects success.
func mustAccept(t *testing.T, dev *vmm.Device, what string, req vmm.Request, payload []byte, fds ...int) {
	t.Helper()
	if _, err := dev.Conn.CallFlags(req, payload, fds, true); err != nil {
		t.Errorf("%s: %v", what, err)
	}
}

// connAlive checks that the connection is in step: a GET_FEATURES gets its
// own answer.
func connAlive(t *testing.T, dev *vmm.Device) {
	t.Helper()
	f, err := dev.Conn.GetFeatures()
	if err != nil || f != wantFeatures {
		t.Fatalf("GET_FEATURES after the previous messages: %#x, %v", f, err)
	}
}

// TestMessageIDs exercises every message id the daemon handles on a running
// device (the ring-lifecycle and memory ones have their own tests too), and
// checks each answer; the FUSE data path keeps working throughout.
func TestMessageIDs(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(ackAll())
	c := newFS(t, dev, 1)
	c.mount()
	cn := dev.Conn

	// 1, 15, 17, 36, 40: the getters.
	connAlive(t, dev)
	if p, err := cn.GetProtocolFeatures(); err != nil || p != wantProtocol {
		t.Errorf("GET_PROTOCOL_FEATURES = %#x, %v", p, err)
	}
	if n, err := cn.GetQueueNum(); err != nil || n != 256 {
		t.Errorf("GET_QUEUE_NUM = %d, %v", n, err)
	}
	if n, err := cn.GetMaxMemSlots(); err != nil || n != 509 {
		t.Errorf("GET_MAX_MEM_SLOTS = %d, %v", n, err)
	}
	if s, err := cn.GetStatus(); err != nil || s != vmm.StatusFeaturesOK {
		t.Errorf("GET_STATUS = %#x, %v", s, err)
	}
	// 2, 3, 16, 39: setters, acked.
	mustAccept(t, dev, "SET_FEATURES", vmm.SetFeatures, vmm.U64(dev.Features))
	mustAccept(t, dev, "SET_OWNER", vmm.SetOwner, nil)
	mustAccept(t, dev, "SET_PROTOCOL_FEATURES", vmm.SetProtocolFeatures, vmm.U64(dev.ProtocolFeatures))
	mustAccept(t, dev, "SET_STATUS", vmm.SetStatus, vmm.U64(vmm.StatusFeaturesOK))
	c.check()

	// 5: a new table with the same regions while the rings run.
	if err := dev.SendMemTable(); err != nil {
		t.Errorf("SET_MEM_TABLE: %v", err)
	}
	c.roundTrip(d, "after-mem-table", pattern(5, 9000))

	// 13, 14: new CALL and ERR fds on a running ring, and NOFD forms.
	fd, err := dev.Queue(1).NewCallFd()
	if err != nil {
		t.Fatal(err)
	}
	mustAccept(t, dev, "SET_VRING_CALL", vmm.SetVringCall, vmm.VringFile(1, false), fd)
	mustAccept(t, dev, "SET_VRING_ERR", vmm.SetVringErr, vmm.VringFile(1, false), eventfd(t))
	mustAccept(t, dev, "SET_VRING_ERR NOFD", vmm.SetVringErr, vmm.VringFile(1, true))
	c.check()

	// 21: a new backend channel; without an fd it is refused.
	ours, theirs, err := vmm.SocketPair()
	if err != nil {
		t.Fatal(err)
	}
	mustAccept(t, dev, "SET_BACKEND_REQ_FD", vmm.SetBackendReqFd, nil, int(theirs.Fd()))
	theirs.Close()
	ours.Close()
	mustRefuse(t, dev, "SET_BACKEND_REQ_FD without fd", vmm.SetBackendReqFd, nil)

	// 24, 25: the config space without --tag.
	if _, err := cn.GetConfig(0, 40, 0); err != nil {
		t.Errorf("GET_CONFIG: %v", err)
	}
	mustRefuse(t, dev, "SET_CONFIG", vmm.SetConfig, vmm.ConfigMsg{Size: 4, Payload: []byte("abcd")}.Bytes())

	// 31: answered with an empty area and no fd.
	m, err := cn.Call(vmm.GetInflightFd, vmm.Inflight{NumQueues: 2, QueueSize: 128}.Bytes(), nil)
	if err != nil {
		t.Errorf("GET_INFLIGHT_FD: %v", err)
	} else {
		if len(m.Payload) != 20 || le.Uint64(m.Payload) != 0 {
			t.Errorf("GET_INFLIGHT_FD answer %x, want 20 bytes with mmap_size 0", m.Payload)
		}
		if len(m.Fds) != 0 {
			t.Errorf("GET_INFLIGHT_FD answer carries %d fds", len(m.Fds))
		}
		m.CloseFds()
	}

	// 6: the dirty log (LOG_SHMFD), answered once: accepted, and refused
	// when the fd holds less than the size claimed.
	if m, err := cn.CallFlags(vmm.SetLogBase, le64(le64(nil, 4096), 0), []int{memfd(t, 4096)}, true); err != nil {
		t.Errorf("SET_LOG_BASE: %v", err)
	} else if v, err := m.U64(); err != nil || v != 0 {
		t.Errorf("SET_LOG_BASE answered %d, %v; want 0", v, err)
	}
	mustRefuse(t, dev, "SET_LOG_BASE beyond its fd", vmm.SetLogBase, le64(le64(nil, 8192), 0), memfd(t, 4096))
	connAlive(t, dev) // one answer each, NEED_REPLY or not
	// 7, 32: not supported, refused.
	mustRefuse(t, dev, "SET_LOG_FD", vmm.SetLogFd, nil, eventfd(t))
	mustRefuse(t, dev, "SET_INFLIGHT_FD", vmm.SetInflightFd, vmm.Inflight{MmapSize: 4096, NumQueues: 2, QueueSize: 128}.Bytes(), memfd(t, 4096))

	// 8, 9, 10, 11, 12, 18: the ring lifecycle, ring by ring.
	for ring := range dev.Queues {
		base, err := dev.StopQueue(ring)
		if err != nil {
			t.Fatalf("stop ring %d: %v", ring, err)
		}
		if err := dev.RestartQueue(ring, base, false); err != nil {
			t.Fatalf("restart ring %d: %v", ring, err)
		}
	}
	c.roundTrip(d, "after-ring-restart", pattern(6, 100))

	// 18 alone: a ring disabled and re-enabled without GET_VRING_BASE
	// serves what was published meanwhile.
	mustAccept(t, dev, "SET_VRING_ENABLE 0", vmm.SetVringEnable, vmm.VringState{Index: 1, Num: 0}.Bytes())
	q := dev.Queue(1)
	fc, err := q.SubmitFuse(getattrRequest(c, vmm.IndirectAuto))
	if err != nil {
		t.Fatal(err)
	}
	q.Kick()
	select {
	case <-fc.Done():
		t.Errorf("a disabled ring served a request")
	case <-time.After(200 * time.Millisecond):
	}
	mustAccept(t, dev, "SET_VRING_ENABLE 1", vmm.SetVringEnable, vmm.VringState{Index: 1, Num: 1}.Bytes())
	if _, err := fc.Wait(opTimeout); err != nil {
		t.Errorf("request published while the ring was disabled: %v", err)
	}
	// 12 on a running ring: the kick fd is replaced.
	kick, err := q.NewKickFd()
	if err != nil {
		t.Fatal(err)
	}
	mustAccept(t, dev, "SET_VRING_KICK on a running ring", vmm.SetVringKick, vmm.VringFile(1, false), kick)
	for range 20 {
		c.check()
	}
	if err := c.Forget(c.lookup(vmm.RootID, "after-ring-restart").NodeID, 1); err != nil {
		t.Errorf("FORGET on hiprio: %v", err)
	}

	// 4, 34 (resets), 37, 38 (hotplug) and the NOFD forms have their own
	// tests.
	connAlive(t, dev)
	c.check()
	noViolations(t, dev)
}

// TestUnknownMessages: ids the daemon does not handle are refused (a
// REPLY_ACK failure when asked for) and the connection goes on.
func TestUnknownMessages(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(ackAll())
	c := newFS(t, dev, 1)
	c.mount()
	ids := []vmm.Request{0, 19, 20, 22, 23, 26, 27, 28, 29, 30, 33, 35, 41, vmm.SetDeviceStateFd, vmm.CheckDeviceState, 44, 1000, 0x7fffffff, 0xffffffff}
	for _, id := range ids {
		mustRefuse(t, dev, id.String(), id, vmm.U64(0))
		// Without NEED_REPLY: nothing comes back, the stream stays in step.
		if err := dev.Conn.Send(id, 0, vmm.U64(1), nil); err != nil {
			t.Fatal(err)
		}
		connAlive(t, dev)
	}
	// SET_DEVICE_STATE_FD with an fd: refused, fd closed.
	mustRefuse(t, dev, "SET_DEVICE_STATE_FD", vmm.SetDeviceStateFd, le32(le32(nil, 0), 0), eventfd(t))
	c.roundTrip(d, "after-unknown", pattern(7, 5000))
	noViolations(t, dev)
}

// TestRefusedFdsClosed: fds that come with refused or fd-less messages are
// closed, and fds the daemon replaces are released: its fd count does not
// grow across 100 rounds of them.
func TestRefusedFdsClosed(t *testing.T) {
	d := startDaemon(t)
	o := ackAll()
	o.Layout = append(vmm.SplitLayout(64*vmm.MiB, 64*vmm.MiB), vmm.RegionSpec{GuestPhysAddr: 8 * vmm.GiB, Size: 4 * vmm.MiB, File: 2})
	o.Hotplug = []int{2}
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	cn := dev.Conn
	log, ev, stray := memfd(t, 4096), eventfd(t), memfd(t, 4096)
	hot := dev.Mem.Regions()[2]
	round := func() {
		t.Helper()
		mustRefuse(t, dev, "SET_LOG_BASE beyond its fd", vmm.SetLogBase, le64(le64(nil, 8192), 0), log)
		if _, err := cn.Call(vmm.SetLogBase, le64(le64(nil, 4096), 0), []int{log}); err != nil {
			t.Fatalf("SET_LOG_BASE: %v", err)
		}
		mustRefuse(t, dev, "SET_LOG_FD", vmm.SetLogFd, nil, ev)
		mustRefuse(t, dev, "SET_INFLIGHT_FD", vmm.SetInflightFd, vmm.Inflight{MmapSize: 4096, NumQueues: 2, QueueSize: 128}.Bytes(), log)
		// Stray fds on a message that takes none.
		m, err := cn.CallFlags(vmm.GetFeatures, nil, []int{stray, ev, log}, false)
		if err != nil {
			t.Fatalf("GET_FEATURES with stray fds: %v", err)
		}
		m.CloseFds()
		// Stray fds on a setter.
		mustAccept(t, dev, "SET_OWNER with fds", vmm.SetOwner, nil, stray, ev)
		// A memory table with more fds than regions, and one with fewer.
		regs := []vmm.MemRegion{dev.Mem.Regions()[0].MemRegion(), dev.Mem.Regions()[1].MemRegion()}
		mustRefuse(t, dev, "SET_MEM_TABLE 2 regions 1 fd", vmm.SetMemTable, vmm.MemTableBytes(regs), dev.Mem.Regions()[0].Fd())
		mustRefuse(t, dev, "SET_MEM_TABLE 1 region 3 fds", vmm.SetMemTable, vmm.MemTableBytes(regs[:1]), stray, ev, log)
		// ADD_MEM_REG with two fds; REM_MEM_REG of nothing, with an fd.
		mustRefuse(t, dev, "ADD_MEM_REG 2 fds", vmm.AddMemReg, vmm.SingleRegionBytes(hot.MemRegion()), hot.Fd(), stray)
		mustRefuse(t, dev, "REM_MEM_REG absent", vmm.RemMemReg, vmm.SingleRegionBytes(hot.MemRegion()), hot.Fd())
		// A region hot-plugged and unplugged (REM_MEM_REG carries the fd).
		if err := dev.AddRegion(2); err != nil {
			t.Fatalf("ADD_MEM_REG: %v", err)
		}
		if err := dev.RemoveRegion(2); err != nil {
			t.Fatalf("REM_MEM_REG: %v", err)
		}
		// The call fd replaced on a running ring.
		fd, err := dev.Queue(1).NewCallFd()
		if err != nil {
			t.Fatal(err)
		}
		mustAccept(t, dev, "SET_VRING_CALL", vmm.SetVringCall, vmm.VringFile(1, false), fd)
		mustAccept(t, dev, "SET_VRING_ERR", vmm.SetVringErr, vmm.VringFile(1, false), ev)
		// A KICK on a ring index that is never configured (the ring is
		// not started: the fd is kept until the next KICK or a reset).
		mustRefuse(t, dev, "SET_VRING_KICK unconfigured ring", vmm.SetVringKick, vmm.VringFile(7, false), ev)
		// A pause/resume of ring 1 (new kick and call fds).
		base, err := dev.StopQueue(1)
		if err != nil {
			t.Fatal(err)
		}
		if err := dev.RestartQueue(1, base, false); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		round() // warm up: the runtime and the rings settle their own fds
	}
	c.check()
	before := d.fdCount()
	for range 100 {
		round()
	}
	c.check()
	after := d.fdCount()
	t.Logf("daemon fds: %d before, %d after 100 rounds", before, after)
	if after > before+2 {
		t.Errorf("daemon fd count grew from %d to %d over 100 rounds: fds leak", before, after)
	}
	c.roundTrip(d, "after-fds", pattern(8, 12345))
	noViolations(t, dev)
}

// TestResetDevice: RESET_DEVICE and RESET_OWNER, on a paused device and on
// one with running rings, then a full restart (new rings at base 0) and a
// new FUSE session work.
func TestResetDevice(t *testing.T) {
	for _, tc := range []struct {
		name    string
		req     vmm.Request
		running bool
	}{
		{"reset-device-stopped", vmm.ResetDevice, false},
		{"reset-device-running", vmm.ResetDevice, true},
		{"reset-owner-stopped", vmm.ResetOwner, false},
		{"reset-owner-running", vmm.ResetOwner, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			dev := d.connect(ackAll())
			c := newFS(t, dev, 1)
			c.mount()
			c.roundTrip(d, "before", pattern(1, 6000))
			if tc.running {
				// Requests in flight while the reset arrives.
				q := dev.Queue(1)
				var calls []*vmm.FuseCall
				for range 16 {
					in := vmm.BuildRequest(c.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
					fc, err := q.SubmitFuse(vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize})
					if err != nil {
						t.Fatal(err)
					}
					calls = append(calls, fc)
				}
				mustAccept(t, dev, tc.req.String(), tc.req, nil)
				// The new rings abandon what the reset left unanswered.
				_ = calls
			} else {
				if _, err := dev.Stop(); err != nil {
					t.Fatal(err)
				}
				mustAccept(t, dev, tc.req.String(), tc.req, nil)
			}
			if err := dev.Restart(true); err != nil {
				t.Fatalf("restart after %v: %v", tc.req, err)
			}
			c.mount()
			if got := d.hostFile("before"); len(got) != 6000 {
				t.Errorf("host file has %d bytes", len(got))
			}
			e := c.lookup(vmm.RootID, "before")
			if e.Attr.Size != 6000 {
				t.Errorf("LOOKUP after reset: size %d", e.Attr.Size)
			}
			c.roundTrip(d, "after", pattern(2, 70000))
			// And a second pause/resume after the reset.
			if _, err := dev.Stop(); err != nil {
				t.Fatal(err)
			}
			if err := dev.Restart(false); err != nil {
				t.Fatal(err)
			}
			c.check()
			noViolations(t, dev)
		})
	}
}

// TestNoFdKickAndCall: SET_VRING_KICK with NOFD makes the daemon poll the
// ring; SET_VRING_CALL with NOFD means no interrupts (the driver polls the
// used ring); a real call fd afterwards brings interrupts back.
func TestNoFdKickAndCall(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(ackAll())
	c := newFS(t, dev, 1)
	c.mount()
	q := dev.Queue(1)
	base, err := dev.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	a, err := q.VringAddr()
	if err != nil {
		t.Fatal(err)
	}
	mustAccept(t, dev, "SET_VRING_NUM", vmm.SetVringNum, vmm.VringState{Index: 1, Num: uint32(q.Size())}.Bytes())
	mustAccept(t, dev, "SET_VRING_BASE", vmm.SetVringBase, vmm.VringState{Index: 1, Num: base}.Bytes())
	mustAccept(t, dev, "SET_VRING_ADDR", vmm.SetVringAddr, a.Bytes())
	mustAccept(t, dev, "SET_VRING_KICK NOFD", vmm.SetVringKick, vmm.VringFile(1, true))
	mustAccept(t, dev, "SET_VRING_ENABLE", vmm.SetVringEnable, vmm.VringState{Index: 1, Num: 1}.Bytes())
	fd, err := q.NewCallFd()
	if err != nil {
		t.Fatal(err)
	}
	mustAccept(t, dev, "SET_VRING_CALL", vmm.SetVringCall, vmm.VringFile(1, false), fd)
	// Kicks go nowhere: the daemon must find the requests by polling.
	c.roundTrip(d, "polled", pattern(1, 20000))

	// No call fd: completions are only visible in the used ring.
	mustAccept(t, dev, "SET_VRING_CALL NOFD", vmm.SetVringCall, vmm.VringFile(1, true))
	time.Sleep(1100 * time.Millisecond) // let vmm's grace period for the old call fd pass
	in := vmm.BuildRequest(c.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
	fc, err := q.SubmitFuse(vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(opTimeout)
	for q.Harvest(); ; q.Harvest() {
		select {
		case <-fc.Done():
		default:
			if time.Now().After(deadline) {
				t.Fatal("request not completed with the call fd withdrawn")
			}
			time.Sleep(time.Millisecond)
			continue
		}
		break
	}
	if b, err := fc.Wait(time.Second); err != nil {
		t.Fatal(err)
	} else if h, _, err := vmm.ParseReply(b); err != nil || h.Error != 0 {
		t.Fatalf("GETATTR with polled completion: %+v %v", h, err)
	}
	// A call fd again, and a new kick fd: interrupts and kicks work.
	if fd, err = q.NewCallFd(); err != nil {
		t.Fatal(err)
	}
	mustAccept(t, dev, "SET_VRING_CALL", vmm.SetVringCall, vmm.VringFile(1, false), fd)
	c.roundTrip(d, "interrupts-again", pattern(2, 3000))
	if base, err = dev.StopQueue(1); err != nil {
		t.Fatal(err)
	}
	if err := dev.RestartQueue(1, base, false); err != nil {
		t.Fatal(err)
	}
	c.check()
	noViolations(t, dev)
}
